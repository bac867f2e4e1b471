"""`python -m bench.speculative`: what speculative decoding buys, and what it costs, on one machine.

    python -m bench.speculative --model models/smollm2 [--methods ngram[,draft]] [--repeats 2]
                                [--draft-layers 8] [--out-dir results]

One stack without speculation ("off") and one per method are launched side by side (float32, greedy
sampling), and every measurement alternates between them, off first then on, then on first then off,
--repeats times: the machines here are shared and noisy, so each figure is quoted for every run, and the
ratio of the medians. Workloads (text, the same requests on every stack):
- edit: "repeat this paragraph, changing X to Y" (chat): the answer quotes the prompt;
- code: completion over a long, regular Python module (raw text): the continuation follows patterns the
  prompt already has;
- chat: plain questions (chat): little to look up;
each at batch 1 (requests one after another) and at batch 8 (eight at once), reporting TPOT; and
- burst: 3 x max_num_seqs chat requests at once, reporting output throughput (speculation's batch-size
  switch should make it no worse).
Beside each figure: the acceptance rate and the mean accepted length (tokens per verification, the
target's own included). Two in-process measurements come first: the forward time of a step by batch size
and query tokens per sequence (what the batch-size switch's default is read from), and the cost of an
n-gram lookup. Writes results/spec-<time>.json and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.client_run import CHANNEL_OPTIONS, speculation_figures
from bench.metrics import RequestResult, summarize
from bench.spec_workloads import requests_for
from common.launcher import running_stack
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc


async def _send(stub, req: pb.GenerateRequest) -> RequestResult:
    result = RequestResult(prompt_tokens=0, send_time=time.perf_counter())
    try:
        async for resp in stub.Generate(req, timeout=1800):
            if resp.token_ids:
                result.chunks.append((time.perf_counter(), len(resp.token_ids)))
            if resp.usage.prompt_tokens:
                result.prompt_tokens = resp.usage.prompt_tokens
        result.end_time = time.perf_counter()
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    return result


async def measure(target: str, requests: list[pb.GenerateRequest], concurrency: int) -> dict:
    """Runs the requests, `concurrency` at a time; returns TPOT, throughput and what speculation did."""
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        before = await stub.GetStats(pb.StatsRequest())
        gate = asyncio.Semaphore(concurrency)

        async def one(req):
            async with gate:
                return await _send(stub, req)

        results = await asyncio.gather(*(one(r) for r in requests))
        after = await stub.GetStats(pb.StatsRequest())
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    run = summarize("run", "spec", list(results))
    return {
        "tpot_ms": run["tpot_ms"]["mean"],
        "output_tokens_per_s": run["output_tokens_per_s"],
        "output_tokens": sum(r.output_tokens for r in results),
        "speculation": speculation_figures(before, after),
    }


# ---- the in-process measurements ----


def step_costs(model: str, batches=(1, 2, 4, 8, 16, 32), query_lens=(1, 2, 3, 5), context: int = 512) -> dict:
    """Median forward ms of a step of `batch` sequences at `context`, each computing `q` query tokens
    (1: a decode; 1 + k: a decode verifying k proposals), alternating the shapes over rounds."""
    import torch

    from shard_worker.capacity import synthetic_step
    from shard_worker.model_runner import ModelRunner
    from shard_worker.parallel import TensorParallel

    runner = ModelRunner(model, torch.float32, torch.device("cpu"), TensorParallel())
    steps, num_blocks = {}, 0
    for b in batches:
        for q in query_lens:
            steps[b, q], blocks = synthetic_step([(q, context)] * b, 16)
            num_blocks = max(num_blocks, blocks)
    runner.allocate_kv_cache(num_blocks, 16)
    runner.warm_up(16)
    times = {key: [] for key in steps}
    for _ in range(2):  # compile and warm every shape
        for step in steps.values():
            runner.execute(step)
    for _ in range(5):
        for key, step in steps.items():
            start = time.perf_counter()
            runner.execute(step)
            times[key].append(time.perf_counter() - start)
    return {f"{b}x{q}": 1000 * statistics.median(t) for (b, q), t in times.items()}


def ngram_cost(length: int = 4000, k: int = 4) -> dict:
    """Microseconds per n-gram proposal as a sequence grows one token at a time, and for the first call
    on a prompt of `length` tokens (which indexes it)."""
    from scheduler.ngram import NgramIndex

    rng = random.Random(0)
    tokens = [rng.randrange(2000) for _ in range(length)]
    index = NgramIndex(2, 4)
    start = time.perf_counter()
    index.propose(tokens[: length // 2], k)
    first = time.perf_counter() - start
    calls, start = 0, time.perf_counter()
    for n in range(length // 2 + 1, length):
        index.propose(tokens[:n], k)
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    return {f"first_call_us_at_len_{length // 2}": 1e6 * first, "per_call_us": 1e6 * per_call}


# ---- the suite ----

RUNS = [  # (workload, batch, requests, max_new_tokens)
    ("edit", 1, 3, 160),
    ("edit", 8, 8, 160),
    ("code", 1, 3, 128),
    ("code", 8, 8, 128),
    ("chat", 1, 3, 128),
    ("chat", 8, 8, 128),
]


def run_suite(a: argparse.Namespace) -> dict:
    report = {"model": a.model, "max_num_seqs": a.max_num_seqs, "runs": [], "burst": []}
    if not a.skip_microbench:
        report["step_costs_ms"] = step_costs(a.model)
        report["ngram_cost"] = ngram_cost()
        print(json.dumps({k: report[k] for k in ("step_costs_ms", "ngram_cost")}, indent=1), flush=True)
    common = (
        "--dtype",
        "float32",
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--num-speculative-tokens",
        str(a.k),
    )
    flags = {"off": ()}
    with contextlib.ExitStack() as stack:
        if "ngram" in a.methods:
            flags["ngram"] = ("--speculative-method", "ngram")
        if "draft" in a.methods:
            from shard_worker.model.draft_builder import build_draft

            draft = build_draft(a.model, stack.enter_context(tempfile.TemporaryDirectory()), a.draft_layers)
            flags["draft"] = ("--speculative-method", "draft", "--speculative-model", str(draft))
        targets = {}
        for name, f in flags.items():
            info, _ = stack.enter_context(running_stack(a.model, *common, *f, timeout_s=900))
            targets[name] = info["target"]
        for name in flags:  # warm-up: compile every shape a workload's first request would
            asyncio.run(measure(targets[name], requests_for("chat", 2, 99, 8), 2))
        for workload, batch, n, max_new in [r for r in RUNS if r[0] in a.workloads]:
            for method in [m for m in flags if m != "off"]:
                row = {"workload": workload, "batch": batch, "method": method, "off": [], "on": []}
                for rep in range(a.repeats):
                    order = ("off", method) if rep % 2 == 0 else (method, "off")
                    for side in order:
                        reqs = requests_for(workload, n, seed=rep * 10, max_new=max_new)
                        got = asyncio.run(measure(targets[side], reqs, batch))
                        row["off" if side == "off" else "on"].append(got)
                        print(f"{workload} b{batch} {side}: {_brief(got)}", flush=True)
                report["runs"].append(row)
        n = 3 * a.max_num_seqs
        for method in [m for m in flags if m != "off" and "burst" in a.workloads]:
            row = {"workload": "burst", "batch": n, "method": method, "off": [], "on": []}
            for rep in range(a.repeats):
                order = ("off", method) if rep % 2 == 0 else (method, "off")
                for side in order:
                    got = asyncio.run(measure(targets[side], requests_for("chat", n, rep, a.burst_tokens), n))
                    row["off" if side == "off" else "on"].append(got)
                    print(f"burst of {n} {side}: {_brief(got)}", flush=True)
            report["burst"].append(row)
    return report


def _brief(got: dict) -> str:
    s = got["speculation"]
    spec = (
        f", acceptance {s['acceptance_rate']:.0%}, mean accepted length {s['mean_accepted_length']:.2f}"
        if s
        else ""
    )
    return f"TPOT {got['tpot_ms']:.1f} ms, {got['output_tokens_per_s']:.1f} tok/s{spec}"


def format_report(report: dict) -> str:
    lines = ["workload  batch  method  TPOT off (ms)     TPOT on (ms)      off/on  acceptance  mean accepted"]
    lines += [_line(row["workload"], row, "tpot_ms", lower_is_better=True) for row in report["runs"]]
    lines.append("")
    lines.append(
        "burst     reqs   method  out tok/s off     out tok/s on      on/off  acceptance  mean accepted"
    )
    lines += [_line("burst", row, "output_tokens_per_s", lower_is_better=False) for row in report["burst"]]
    return "\n".join(lines)


def _line(label: str, row: dict, key: str, lower_is_better: bool) -> str:
    """One row: both sides' runs, and the ratio of medians that reads as speculation's gain."""
    off, on = [g[key] for g in row["off"]], [g[key] for g in row["on"]]
    ratio = statistics.median(off) / statistics.median(on)
    ratio = ratio if lower_is_better else 1 / ratio
    return (
        f"{label:<8}  {row['batch']:>5}  {row['method']:<6}  {_runs(off):<16}  "
        f"{_runs(on):<16}  {ratio:>5.2f}x  {_acceptance(row['on'])}"
    )


def _runs(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def _acceptance(runs: list[dict]) -> str:
    figures = [g["speculation"] for g in runs if g["speculation"]]
    if not figures:
        return "(no proposals)"
    rate = " / ".join(f"{f['acceptance_rate']:.0%}" for f in figures)
    length = " / ".join(f"{f['mean_accepted_length']:.2f}" for f in figures)
    return f"{rate:<10}  {length}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--methods", default="ngram", help="comma-separated: ngram, draft")
    p.add_argument("--draft-layers", type=int, default=8, help="draft: the model's first N layers")
    p.add_argument("--repeats", type=int, default=2, help="alternating on/off runs per figure")
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument(
        "--max-num-seqs", type=int, default=16, help="the stacks' --max-num-seqs (the burst is 3x)"
    )
    p.add_argument("--burst-tokens", type=int, default=48, help="output tokens per burst request")
    p.add_argument("--workloads", default="edit,code,chat,burst", help="comma-separated: a subset")
    p.add_argument("--skip-microbench", action="store_true", help="no step-cost and n-gram timings")
    p.add_argument("--out-dir", default="results")
    a = p.parse_args(argv)
    a.methods = tuple(m for m in a.methods.split(",") if m)
    a.workloads = tuple(w for w in a.workloads.split(",") if w)
    report = run_suite(a)
    out = Path(a.out_dir) / f"spec-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_report(report))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
