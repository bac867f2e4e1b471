"""Attention backends side by side on one layer: decode steps of 32 and 128 sequences at contexts 512 and
2048, and one mixed step (a 1,900-token prompt, 30 short prompts and 64 decodes at 2,048), in float32 on
this machine's device, at SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64).

    .venv/bin/python -m bench.attention [--backends flex,reference] [--rounds 3] [--window 0] [--sinks]

--sinks gives the layer gpt-oss's attention sinks (a logit per head; the backends that serve them: cpu,
triton, reference), to compare with a run without.

Each figure is the best of --rounds (a neighbour's burst of work then costs a round, not a case), after
one untimed call that compiles (a worker does this at start-up). Ratios from one run are what to quote.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from shard_worker.attention import Attention, StepBatch, select_backend

BLOCK_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
DECODE_CASES = [(32, 512), (128, 512), (32, 2048), (128, 2048)]
MIXED_STEP = [(1900, 1900)] + [(5, 5)] * 30 + [(1, 2048)] * 64


def make_batch(lens: list[tuple[int, int]], rng: random.Random, num_blocks: int, device) -> StepBatch:
    """(query_len, context_len) per sequence; each gets its own blocks in a scrambled order."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-c // BLOCK_SIZE))] for _, c in lens]
    table = np.zeros((len(lens), max(len(t) for t in tables)), dtype=np.int64)
    for row, t in zip(table, tables, strict=True):
        row[: len(t)] = t
    q = np.array([q for q, _ in lens])
    c = np.array([c for _, c in lens])
    return StepBatch.build(np.zeros(int(q.sum()), dtype=np.int64), q, c, table, BLOCK_SIZE, device)


def time_step(backend, layer, batch: StepBatch, cache: torch.Tensor, rounds: int) -> float:
    """Best seconds of one layer's attention (the KV write and the metadata included) over rounds."""
    t, like = batch.num_tokens, {"device": cache.device, "dtype": cache.dtype}
    q = torch.randn(t, layer.num_heads, layer.head_dim, **like)
    k, v = (torch.randn(t, layer.num_kv_heads, layer.head_dim, **like) for _ in range(2))
    best = float("inf")
    with torch.inference_mode():
        for i in range(rounds + 1):
            start = time.perf_counter()
            layer(q, k, v, cache, backend.context(batch))  # metadata included: a step builds it once
            if cache.device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first call compiles or warms up
                best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="flex,reference")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=int, default=0, help="sliding window of the layer (0: none)")
    p.add_argument("--sinks", action="store_true", help="the layer has gpt-oss's attention sinks")
    a = p.parse_args()
    torch.set_flush_denormal(True)
    device = torch.device(a.device)
    names = a.backends.split(",")
    num_blocks = max(n * -(-c // BLOCK_SIZE) for n, c in DECODE_CASES + [(len(MIXED_STEP), 2048)])
    cache = torch.rand(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device) - 0.5
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, sliding_window=a.window or None)
    if a.sinks:
        layer.sinks = torch.linspace(-2.0, 2.0, HEADS, device=device)
    cases = [(f"decode {n} x {c}", [(1, c)] * n) for n, c in DECODE_CASES] + [("mixed step", MIXED_STEP)]
    print(f"{'case':>20} " + " ".join(f"{n + ' ms':>14}" for n in names) + f"  {names[-1]}/{names[0]}")
    for title, lens in cases:
        batch = make_batch(lens, random.Random(0), num_blocks, device)
        times = [
            time_step(select_backend(n, device, torch.float32), layer, batch, cache, a.rounds) for n in names
        ]
        print(
            f"{title:>20} " + " ".join(f"{t * 1e3:14.2f}" for t in times) + f"  {times[-1] / times[0]:.2f}x"
        )


if __name__ == "__main__":
    main()
