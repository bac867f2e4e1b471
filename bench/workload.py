"""Seeded benchmark workloads: prompt and output lengths, prompt token ids, and arrival times.

Plain numpy, no gRPC and no torch, so every system under test (the server and the in-process baselines)
rebuilds exactly the same requests from the same (spec, n, seed, vocab).

Arrivals follow vLLM's benchmark_serving: gaps are gamma-distributed with shape `burstiness` and mean
1/rate, so burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. An infinite rate
sends everything at t=0. The lengths and the arrivals come from independent child streams of the seed,
so changing the rate never changes the requests themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    prompt_min: int
    prompt_max: int  # inclusive
    output_mean: float  # exponential mean, before the cap
    output_max: int  # inclusive cap
    output_min: int = 1

    def __post_init__(self):
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(
                f"prompt length range must satisfy 1 <= min <= max, got {self.prompt_min}..{self.prompt_max}"
            )
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError(
                f"output length range must satisfy 1 <= min <= max, got {self.output_min}..{self.output_max}"
            )
        if self.output_mean <= 0:
            raise ValueError(f"output mean must be > 0, got {self.output_mean}")


WORKLOADS = {
    "chat": WorkloadSpec("chat", prompt_min=16, prompt_max=256, output_mean=96, output_max=256),
    "mixed": WorkloadSpec("mixed", prompt_min=50, prompt_max=1024, output_mean=96, output_max=256),
}


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int  # honoured exactly: sent with ignore_eos
    arrival_s: float  # offset from the start of the run


def sample_lengths(spec: WorkloadSpec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens, output_lens): prompts uniform in [min, max]; outputs exponential, rounded, clipped."""
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[0])
    prompt = rng.integers(spec.prompt_min, spec.prompt_max + 1, size=n)
    output = np.rint(rng.exponential(spec.output_mean, size=n)).astype(np.int64)
    return prompt, np.clip(output, spec.output_min, spec.output_max)


def sample_arrivals(n: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Arrival offsets (s), the first at 0. Gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness))."""
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n)
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def build_requests(
    spec: WorkloadSpec,
    n: int,
    *,
    vocab_size: int,
    seed: int = 0,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_model_len: int | None = None,
    exclude_ids: tuple[int, ...] = (),
) -> list[BenchRequest]:
    """n requests with random prompt token ids below vocab_size (never one of exclude_ids, e.g. EOS)."""
    if n <= 0:
        raise ValueError(f"number of requests must be > 0, got {n}")
    prompt_lens, output_lens = sample_lengths(spec, n, seed)
    arrivals = sample_arrivals(n, request_rate, burstiness, seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(exclude_ids, dtype=np.int64))
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
    out = []
    for i in range(n):
        plen, olen = int(prompt_lens[i]), int(output_lens[i])
        if max_model_len is not None:
            # The server rejects prompt + max_new_tokens > max_model_len; shrink the output, then the prompt.
            plen = min(plen, max_model_len - 1)
            olen = min(olen, max_model_len - plen)
        ids = rng.choice(allowed, size=plen)
        out.append(BenchRequest(i, tuple(int(t) for t in ids), olen, float(arrivals[i])))
    return out
