"""Goodput under overload (issue 32): Poisson arrivals from 0.5x to 3x the rate the stack sustains, for
tpserve with latency objectives (the router refuses what would miss its TTFT) and without, reporting
goodput as `vllm bench serve --goodput` defines it (completed requests per second meeting every objective),
refusals, and p99 TTFT and TPOT of the requests that were served.

    python -m bench.goodput --model models/smollm2 [--ttft-ms 2000] [--tpot-ms 200] [--rates 0.5,1,2,3]

The sustainable rate is measured first, on the stack without objectives: every request of a burst sent at
once, completed requests per second. Each arm gets one freshly launched stack; the same seeded requests
and arrival times for every point of both arms. Figures on a shared CPU are noisy: compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from bench.client_run import bench_server
from bench.workload import WORKLOADS
from common.launcher import running_stack


def point(target: str, spec, n: int, rate: float, ttft_ms: float, tpot_ms: float, seed: int) -> dict:
    run, extra, _ = asyncio.run(
        bench_server(
            target,
            spec,
            n,
            name="x",
            seed=seed,
            request_rate=rate,
            slo_ttft_ms=ttft_ms,
            slo_tpot_ms=tpot_ms,
            progress=False,
            warmup=False,
        )
    )
    return {
        "rate": rate,
        "goodput_rps": run["goodput_rps"],
        "completed": extra["completed"],
        "refused": extra["num_requests"] - extra["completed"],
        "errors": extra["errors"][:2],
        "ttft_p99_ms": run["ttft_ms"]["p99"],
        "tpot_p99_ms": run["tpot_ms"]["p99"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--tpot-ms", type=float, default=200.0)
    p.add_argument("--rates", default="0.5,1,2,3", help="multiples of the sustainable rate")
    p.add_argument("--num-requests", type=int, default=40, help="per point")
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--output-mean", type=float, default=32.0)
    p.add_argument("--output-max", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the table as JSON here")
    a = p.parse_args(argv)
    spec = dataclasses.replace(
        WORKLOADS["chat"], prompt_max=a.prompt_max, output_mean=a.output_mean, output_max=a.output_max
    )
    multiples = [float(x) for x in a.rates.split(",")]
    base = ("--max-num-seqs", str(a.max_num_seqs), "--admission-window", str(a.max_num_seqs))
    slo = ("--slo-ttft-ms", str(int(a.ttft_ms)), "--slo-tpot-ms", str(int(a.tpot_ms)))
    rows, sustained = [], None
    for arm, flags in (("no objectives", base), ("objectives", base + slo)):
        with running_stack(a.model, *flags, timeout_s=300) as (info, _):
            target = info["target"]
            # A warm-up burst first: the first steps of each shape compile (flex attention on CPU), and the
            # router's estimate learns from served requests.
            asyncio.run(bench_server(target, spec, a.num_requests, seed=a.seed + 2, progress=False))
            if sustained is None:
                run, _, _ = asyncio.run(
                    bench_server(target, spec, a.num_requests, seed=a.seed + 1, progress=False)
                )
                sustained = run["requests_per_s"]
                print(f"sustainable: {sustained:.2f} req/s (a burst of {a.num_requests})", flush=True)
            for m in multiples:
                row = point(target, spec, a.num_requests, m * sustained, a.ttft_ms, a.tpot_ms, a.seed)
                row |= {"arm": arm, "multiple": m}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(table(rows, a.ttft_ms, a.tpot_ms))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"sustained_rps": sustained, "rows": rows, "args": vars(a)}, f, indent=1)
    return 0


def table(rows: list[dict], ttft_ms: float, tpot_ms: float) -> str:
    one = {r["arm"]: r["goodput_rps"] for r in rows if r["multiple"] == 1.0}
    out = [
        f"objectives TTFT {ttft_ms:.0f} ms, TPOT {tpot_ms:.0f} ms; p99 over served requests",
        "| arm | load | req/s | goodput | vs own 1x | served | refused | p99 TTFT ms | p99 TPOT ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = r["goodput_rps"] / one[r["arm"]] if one.get(r["arm"]) else float("nan")
        out.append(
            f"| {r['arm']} | {r['multiple']}x | {r['rate']:.2f} | {r['goodput_rps']:.2f} | {rel:.2f} | "
            f"{r['completed']} | {r['refused']} | {_ms(r['ttft_p99_ms'])} | {_ms(r['tpot_p99_ms'])} |"
        )
    return "\n".join(out)


def _ms(v) -> str:
    return "-" if v is None or v != v else f"{v:.0f}"


if __name__ == "__main__":
    sys.exit(main())
