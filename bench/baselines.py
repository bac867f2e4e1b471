"""In-process transformers baselines, fed the same seeded workload as the server.

- padded: `model.generate` on left-padded batches of up to `batch_size` requests, the way users batch
  without a server. A batch is formed from the requests that have arrived when the previous one ends (or
  waits for the next arrival) and runs for its longest request's output; a request's tokens are stamped
  at the decoding step that produced them (a streamer), and it ends when `generate` returns, since that is
  when the caller gets it.
- continuous: transformers' own continuous batching (ContinuousBatchingManager via
  `init_continuous_batching`, paged KV, FIFO scheduler), requests added at their arrival times; TTFT and
  token gaps come from the manager's own per-token timestamps (record_timestamps).

Both decode greedily with EOS disabled, so output lengths match the workload exactly, like the server's
ignore_eos. Run as a subprocess (`python -m bench.baselines ...`, see main) so each baseline's peak RSS is
its own process's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints
from transformers.generation.streamers import BaseStreamer

from bench.metrics import RequestResult
from bench.workload import BenchRequest, WorkloadSpec, build_requests

SYSTEMS = ("padded", "continuous")


@dataclass(frozen=True)
class CachePolicy:
    """The server's defaults (scheduler/config.py), applied to transformers' continuous batching."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_gib: float = 2.0  # the server's --cpu-kv-cache-gib


def load_model(model_dir: str, dtype: str = "float32"):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


def workload_for(model, spec: WorkloadSpec, n: int, seed: int, rate: float, burstiness: float):
    """The same requests the server is sent: vocab, EOS ids and context length taken from the checkpoint."""
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos = model.config.eos_token_id if eos is None else eos
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return build_requests(
        spec,
        n,
        vocab_size=model.config.vocab_size,
        seed=seed,
        request_rate=rate,
        burstiness=burstiness,
        max_model_len=model.config.max_position_embeddings,
        exclude_ids=eos_ids,
    )


class _StepClock(BaseStreamer):
    """Stamps each decoding step; generate's first put() is the prompt, not a step."""

    def __init__(self):
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value):
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self):
        pass


def _greedy_no_eos(max_new_tokens: int, pad_id: int) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,  # belt and braces: EOS is also disabled below
        eos_token_id=None,
        pad_token_id=pad_id,
    )


@torch.inference_mode()
def _generate_batch(model, batch: list[BenchRequest], pad_id: int) -> tuple[list[float], float]:
    longest = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, longest - len(r.prompt_ids) :] = 1
    clock = _StepClock()
    steps = max(r.max_new_tokens for r in batch)
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=_greedy_no_eos(steps, pad_id), streamer=clock
    )
    done = time.perf_counter()
    if out.shape[1] - longest != steps or len(clock.times) != steps:
        raise RuntimeError(
            f"generate ran {out.shape[1] - longest} steps ({len(clock.times)} stamped), not {steps}"
        )
    return clock.times, done


def run_padded(
    model, requests: list[BenchRequest], batch_size: int = 32
) -> tuple[list[RequestResult], float]:
    """(results in request order, mean rows per decoding step including padding rows)."""
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    results: list[RequestResult | None] = [None] * len(requests)
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    rows_steps = steps_total = 0
    start = time.perf_counter()
    while pending:
        wait = start + pending[0].arrival_s - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        now = time.perf_counter() - start
        batch = []
        while pending and len(batch) < batch_size and pending[0].arrival_s <= now:
            batch.append(pending.popleft())
        step_times, done = _generate_batch(model, batch, pad_id)
        rows_steps += len(batch) * len(step_times)
        steps_total += len(step_times)
        for r in batch:
            res = RequestResult(prompt_tokens=len(r.prompt_ids), send_time=start + r.arrival_s, end_time=done)
            res.chunks = [(t, 1) for t in step_times[: r.max_new_tokens]]
            results[r.index] = res
    return results, rows_steps / max(steps_total, 1)


def continuous_config(model, requests: list[BenchRequest], policy: CachePolicy) -> ContinuousBatchingConfig:
    """The server's policy knobs, in transformers' terms.

    Left to itself on CPU, transformers sizes its cache from 90% of free host memory (gigabytes of zeros,
    and attention-mask buffers that grow with it); the server gets a fixed KV budget, so this gets the same
    one, or less when the workload cannot use it all.
    """
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    page = ContinuousBatchingConfig().page_size
    bytes_per_block = (
        2 * cfg.num_hidden_layers * page * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
    )
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    needed = math.ceil(min(policy.max_num_seqs, len(requests)) * longest / page) + 1
    budget = int(policy.kv_cache_gib * 2**30) // bytes_per_block
    return ContinuousBatchingConfig(
        num_blocks=max(1, min(needed, budget)),
        max_batch_tokens=policy.max_num_batched_tokens,
        max_requests_per_batch=policy.max_num_seqs,
    )


@torch.inference_mode()
def run_continuous(
    model, requests: list[BenchRequest], policy: CachePolicy | None = None
) -> list[RequestResult]:
    """transformers' ContinuousBatchingManager, each request added at its arrival time."""
    longest_out = max(r.max_new_tokens for r in requests)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    gen_cfg = GenerationConfig(
        do_sample=False, max_new_tokens=longest_out, eos_token_id=-1, pad_token_id=pad_id
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_ids) for r in requests),
        max_generated_length=longest_out,
        num_requests=len(requests),
    )
    manager = model.init_continuous_batching(
        generation_config=gen_cfg,
        continuous_batching_config=continuous_config(model, requests, policy or CachePolicy()),
        workload_hints=hints,
    )
    manager.warmup()
    manager.start()
    by_id = {f"bench-{r.index}": r for r in requests}
    results: dict[str, RequestResult] = {}
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    try:
        start = time.perf_counter()
        while len(results) < len(requests):
            while pending and start + pending[0].arrival_s <= time.perf_counter():
                r = pending.popleft()
                # eos_token_id=-1: no token ends a request early, as with the server's ignore_eos.
                manager.add_request(
                    list(r.prompt_ids),
                    request_id=f"bench-{r.index}",
                    max_new_tokens=r.max_new_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            timeout = 0.05
            if pending:
                timeout = min(timeout, max(0.0, start + pending[0].arrival_s - time.perf_counter()))
            out = manager.get_result(timeout=timeout)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped before finishing")
                continue
            if not out.is_finished():
                continue
            req = by_id[out.request_id]
            res = RequestResult(prompt_tokens=len(req.prompt_ids), send_time=out.created_time)
            if out.error is not None:
                res.error = str(out.error)
            else:
                res.chunks = [(t, 1) for t in (out.timestamps or [])]
                res.end_time = out.lifespan[1] if out.lifespan[1] > 0 else res.chunks[-1][0]
            results[out.request_id] = res
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    return [results[f"bench-{r.index}"] for r in requests]


def warm_up(model, system: str) -> None:
    """One short run so lazy initialisation (kernels, allocator) is not timed."""
    reqs = [BenchRequest(i, tuple(range(2, 18)), 4, 0.0) for i in range(2)]
    if system == "padded":
        run_padded(model, reqs, batch_size=2)
    else:
        run_continuous(model, reqs)


def _self_peak_rss_mb() -> float | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return None


def result_to_json(r: RequestResult) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "send_time": r.send_time,
        "chunks": r.chunks,
        "end_time": r.end_time,
        "error": r.error,
    }


def result_from_json(d: dict) -> RequestResult:
    return RequestResult(
        prompt_tokens=d["prompt_tokens"],
        send_time=d["send_time"],
        chunks=[(t, n) for t, n in d["chunks"]],
        end_time=d["end_time"],
        error=d["error"],
    )


def main(argv: list[str] | None = None) -> int:
    """Runs one baseline and writes {"results", "peak_rss_mb", "mean_batch_size", "error"} as JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.baselines", description=__doc__)
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--spec", required=True, help="WorkloadSpec fields as JSON")
    p.add_argument("--num-requests", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    report: dict = {"results": [], "peak_rss_mb": {}, "mean_batch_size": None, "error": None}
    try:
        model = load_model(a.model, a.dtype)
        spec = WorkloadSpec(**json.loads(a.spec))
        requests = workload_for(model, spec, a.num_requests, a.seed, a.request_rate, a.burstiness)
        warm_up(model, a.system)
        if a.system == "padded":
            results, report["mean_batch_size"] = run_padded(model, requests, a.batch_size)
        else:
            results = run_continuous(model, requests)
        report["results"] = [result_to_json(r) for r in results]
    except Exception as e:  # recorded in the report: the suite says why a baseline has no figures
        traceback.print_exc()
        report["error"] = f"{type(e).__name__}: {e}"
    report["peak_rss_mb"] = {"transformers": _self_peak_rss_mb()}
    Path(a.out).write_text(json.dumps(report))
    return 0 if report["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
