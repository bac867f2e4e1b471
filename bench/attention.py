"""Attention benchmark (not a test): prints tables, asserts nothing.

1. The decode step of a model through ModelRunner.execute (the whole forward and sampling), at 32 and 128
   sequences and contexts 512 and 2048, with the paged attention and with the gather implementation it
   replaced (tests/unit/attention_reference.py). Blocks are scrambled and every sequence has its own.
2. The peak RSS growth of a process running one mixed step (a 1,900-token prompt, thirty 5-token prompts
   and 64 decodes at context 2048) once, with each implementation, and with attention stubbed out: that
   last one is the step's other activations.
3. The first step of fresh processes sharing an empty TORCHINDUCTOR_CACHE_DIR: the first compiles the
   attention kernels (cold), the next ones load them (warm).

    .venv/bin/python -m bench.attention --model /tmp/small [--profile]

Time ratios within one run are what to read: the CPUs may be shared. --profile prints torch.profiler's
top operators for the 128 x 2048 decode step and the mixed step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from common.sampling import SamplingConfig
from shard_worker.model import attention
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit, StepInputs
from tests.unit.attention_reference import reference_attention

BLOCK_SIZE = 16
DECODE_CASES = [(32, 512), (128, 512), (32, 2048), (128, 2048)]
# (query_len, context_len) per sequence.
MIXED_STEP = [(1900, 1900)] + [(5, 5)] * 30 + [(1, 2048)] * 64


def make_step(lens: list[tuple[int, int]], rng: random.Random, num_blocks: int) -> StepInputs:
    """Each sequence gets its own blocks, drawn in a scrambled order from a cache of num_blocks."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    step = StepInputs([], [], [], [], [], [], [], [], [])
    for seq_id, (q, c) in enumerate(lens):
        table = [pool.pop() for _ in range(-(-c // BLOCK_SIZE))]
        step.seq_ids.append(seq_id)
        step.query_lens.append(q)
        step.context_lens.append(c)
        step.do_sample.append(True)
        step.input_ids += [rng.randrange(1000) for _ in range(q)]
        step.positions += range(c - q, c)
        step.slot_mapping += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c - q, c)]
        step.block_table_lens.append(len(table))
        step.block_tables += table
    return step


def blocks_for(lens: list[tuple[int, int]]) -> int:
    return sum(-(-c // BLOCK_SIZE) for _, c in lens)


def new_runner(model: str, num_blocks: int, num_seqs: int) -> ModelRunner:
    runner = ModelRunner(model, torch.float32, torch.device("cpu"), TensorParallel())
    runner.allocate_kv_cache(num_blocks, BLOCK_SIZE)
    for cache in runner.kv_caches:
        cache.uniform_(-1, 1)  # touched pages with values, as a cache in use has
    greedy = SamplingConfig(temperature=0.0)
    runner.add_sequences([SequenceInit(s, greedy, 0, [0], 1) for s in range(num_seqs)])
    return runner


def bench_decodes(model: str, rounds: int, profile: bool) -> list[tuple[int, int, float, float]]:
    rng = random.Random(0)
    num_blocks = max(n * -(-c // BLOCK_SIZE) for n, c in DECODE_CASES)
    runner = new_runner(model, num_blocks, max(n for n, _ in DECODE_CASES))
    steps = [make_step([(1, c)] * n, rng, num_blocks) for n, c in DECODE_CASES]
    runner.execute(steps[0])  # compiles (a server does this at start-up)
    best = {}
    # Every round times every case with both implementations, the best of each kept: a neighbour's
    # burst of work then costs a round, not a case.
    for _ in range(rounds):
        for case, step in zip(DECODE_CASES, steps, strict=True):
            for impl, ctx in (("new", nullcontext), ("old", lambda: reference_attention(runner))):
                with ctx():
                    runner.execute(step)  # first touch of this case's buffers, not timed
                    start = time.perf_counter()
                    runner.execute(step)
                    elapsed = time.perf_counter() - start
                best[case, impl] = min(best.get((case, impl), float("inf")), elapsed)
    if profile:
        step = steps[DECODE_CASES.index((128, 2048))]
        for name, ctx in (("paged (new)", nullcontext()), ("gather (old)", reference_attention(runner))):
            with ctx:
                print_profile(f"decode 128 x 2048, {name}", lambda s=step: runner.execute(s))
    return [(n, c, best[(n, c), "new"], best[(n, c), "old"]) for n, c in DECODE_CASES]


def print_profile(title: str, fn) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fn()
    print(f"\n--- torch.profiler: {title} (3 steps) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))


def memory_status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


class NoAttention(torch.nn.Module):
    def forward(self, q, k, v, kv_cache, md):
        return q


def probe_memory(model: str, variant: str, profile: bool) -> dict:
    """Runs the mixed step once in this (fresh) process and reports its peak RSS growth."""
    torch.set_flush_denormal(True)
    rng = random.Random(1)
    num_blocks = blocks_for(MIXED_STEP) + 8
    runner = new_runner(model, num_blocks, len(MIXED_STEP))
    if variant == "none":
        for layer in runner.model.model.layers:
            layer.self_attn.attn = NoAttention()
    ctx = reference_attention(runner) if variant == "old" else nullcontext()
    with ctx:
        # Compiles (new) and loads everything lazily loaded, outside the measured step.
        runner.execute(make_step([(1, 40), (20, 20)], rng, num_blocks))
        step = make_step(MIXED_STEP, rng, num_blocks)
        before = memory_status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        start = time.perf_counter()
        runner.execute(step)
        seconds = time.perf_counter() - start
        peak = memory_status()["VmHWM"]
        if profile and variant != "none":
            print_profile(f"mixed step, {variant}", lambda: runner.execute(step))
        if profile and variant == "new":
            # What block tiles bought: the same step with every token in a one-token tile.
            saved, attention.PREFILL_MIN_QUERY = attention.PREFILL_MIN_QUERY, sys.maxsize
            try:
                runner.execute(step)
                print_profile("mixed step, new, one-token tiles only", lambda: runner.execute(step))
            finally:
                attention.PREFILL_MIN_QUERY = saved
    return {"variant": variant, "peak_growth": peak - before, "seconds": seconds}


def probe_compile(model: str) -> dict:
    """Seconds this (fresh) process spends on its first step with a decode and a prompt: compiling both
    attention kernels, or loading them from the inductor cache."""
    rng = random.Random(2)
    runner = new_runner(model, 64, 2)
    step = make_step([(1, 40), (2 * BLOCK_SIZE, 2 * BLOCK_SIZE)], rng, 64)
    start = time.perf_counter()
    runner.execute(step)
    first = time.perf_counter() - start
    start = time.perf_counter()
    runner.execute(step)
    return {"first": first, "second": time.perf_counter() - start}


def bench_compile(model: str) -> list[dict]:
    """Cold (empty cache directory), then warm, in fresh processes sharing one TORCHINDUCTOR_CACHE_DIR."""
    results = []
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
        for _ in range(3):
            cmd = [sys.executable, "-m", "bench.attention", "--model", model, "--probe-compile"]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def bench_memory(model: str, profile: bool) -> list[dict]:
    results = []
    # A fixed mmap threshold: glibc would otherwise start serving large buffers from its heap after the
    # first free, keeping them resident, and later growth would go unseen.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for variant in ("new", "old", "none"):
        cmd = [sys.executable, "-m", "bench.attention", "--model", model, "--probe-memory", variant]
        cmd += ["--threads", str(torch.get_num_threads())]
        if profile:
            cmd.append("--profile")
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        lines = out.strip().splitlines()
        print("\n".join(lines[:-1]))  # the profile, if asked for
        results.append(json.loads(lines[-1]))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint directory, e.g. the small preset's")
    p.add_argument("--rounds", type=int, default=5, help="timed decode steps per case and implementation")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler tables too")
    p.add_argument("--probe-memory", choices=["new", "old", "none"], help=argparse.SUPPRESS)
    p.add_argument("--probe-compile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_flush_denormal(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe_memory:
        print(json.dumps(probe_memory(args.model, args.probe_memory, args.profile)))
        return
    if args.probe_compile:
        print(json.dumps(probe_compile(args.model)))
        return

    compiles = bench_compile(args.model)
    rows = bench_decodes(args.model, args.rounds, args.profile)
    mem = {r["variant"]: r for r in bench_memory(args.model, args.profile)}
    print("\nFirst step of a fresh process (decode + prompt), compiling or loading the attention kernels")
    for label, r in zip(("cold cache", "warm cache", "warm cache"), compiles, strict=True):
        print(f"{label:>12}: first step {r['first']:6.2f} s, second {r['second']:6.3f} s")
    print(f"\nDecode step, ModelRunner.execute, {args.model}, float32, {torch.get_num_threads()} threads")
    print(f"{'seqs':>5} {'context':>8} {'paged ms':>9} {'gather ms':>10} {'gather/paged':>13}")
    for num_seqs, context, new, old in rows:
        print(f"{num_seqs:>5} {context:>8} {new * 1e3:>9.1f} {old * 1e3:>10.1f} {old / new:>13.2f}")
    tokens = sum(q for q, _ in MIXED_STEP)
    print(f"\nMixed step ({tokens} tokens: 1,900-token prompt, 30 x 5-token prompts, 64 decodes at 2048)")
    print(f"{'attention':>22} {'peak RSS growth MiB':>20} {'step s':>7}")
    names = {"new": "paged (new)", "old": "gather (old)", "none": "none (activations)"}
    for variant in ("new", "old", "none"):
        r = mem[variant]
        print(f"{names[variant]:>22} {r['peak_growth'] / 2**20:>20.1f} {r['seconds']:>7.2f}")


if __name__ == "__main__":
    main()
