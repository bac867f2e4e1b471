"""`make bench`: tpserve against static batching and transformers, on one machine, in one run.

    python -m bench.suite --model models/small [--num-requests 128] [--workload chat] [--out-dir results]

Phase 1 sends the whole workload at once to (a) tpserve continuous, (b) tpserve static (batch 32),
(c) transformers `generate` on padded batches of 32 and (d) transformers' continuous batching. Phase 2
sends it again as Poisson arrivals at --rate-fraction of (b)'s phase-1 request throughput ("near static's
capacity"). Each tpserve run gets a freshly launched stack and each transformers run its own process, so
every peak RSS belongs to that run alone. Machines here are shared and noisy: read the ratios to (a), not
the absolute times. Writes results/bench-<time>.json and .png; prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.baselines import result_from_json
from bench.cli import add_workload_arguments, workload_from_args
from bench.client_run import bench_server
from bench.metrics import details, latency_samples_ms, summarize
from bench.report import format_table, plot, write_json
from bench.workload import WorkloadSpec
from common.launcher import LaunchFailed, running_stack

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("tpserve-continuous", "tpserve-static", "hf-padded", "hf-continuous")


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    model: str
    spec: WorkloadSpec
    num_requests: int
    seed: int
    static_batch_size: int
    rate_fraction: float
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    dtype: str
    systems: tuple[str, ...]
    launch_timeout_s: float


@contextlib.contextmanager
def launched(model: str, *flags: str, timeout_s: float):
    """`tpserve launch` on a free port; yields its ready info ({target, pids}); stops it by its pid."""
    with running_stack(model, *flags, timeout_s=timeout_s) as (info, _):
        yield info


def run_tpserve(cfg: SuiteConfig, name: str, rate: float, flags: tuple[str, ...]) -> tuple[dict, dict]:
    """A fresh stack per run (so peak RSS is this run's); a stack that fails to start gets one more try."""
    try:
        return _run_tpserve_once(cfg, name, rate, flags)
    except LaunchFailed as e:
        print(f"== {name}: {e}; launching once more", file=sys.stderr, flush=True)
        return _run_tpserve_once(cfg, name, rate, flags)


def _run_tpserve_once(cfg: SuiteConfig, name: str, rate: float, flags: tuple[str, ...]) -> tuple[dict, dict]:
    with launched(cfg.model, "--dtype", cfg.dtype, *flags, timeout_s=cfg.launch_timeout_s) as info:
        run, extra, _ = asyncio.run(
            bench_server(
                info["target"],
                cfg.spec,
                cfg.num_requests,
                name=name,
                seed=cfg.seed,
                request_rate=rate,
                slo_ttft_ms=cfg.slo_ttft_ms,
                slo_tpot_ms=cfg.slo_tpot_ms,
                pids=info["pids"],
            )
        )
    return run, extra


def run_baseline(cfg: SuiteConfig, name: str, rate: float, system: str) -> tuple[dict, dict]:
    """One transformers baseline in its own process (so its VmHWM is its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baseline.json"
        cmd = [sys.executable, "-m", "bench.baselines", "--system", system, "--model", cfg.model]
        cmd += ["--dtype", cfg.dtype, "--spec", json.dumps(dataclasses.asdict(cfg.spec))]
        cmd += ["--num-requests", str(cfg.num_requests), "--seed", str(cfg.seed), "--request-rate", str(rate)]
        cmd += ["--batch-size", str(cfg.static_batch_size), "--out", str(out)]
        subprocess.run(cmd, cwd=ROOT, check=False)
        if not out.exists():
            raise RuntimeError(f"python -m bench.baselines --system {system} wrote no report")
        report = json.loads(out.read_text())
    if report["error"]:
        raise RuntimeError(report["error"])
    results = [result_from_json(r) for r in report["results"]]
    run = summarize(
        name,
        cfg.spec.name,
        results,
        slo_ttft_ms=cfg.slo_ttft_ms,
        slo_tpot_ms=cfg.slo_tpot_ms,
        peak_rss_mb=report["peak_rss_mb"],
        mean_batch_size=report["mean_batch_size"],
    )
    extra = details(results)
    extra["samples_ms"] = latency_samples_ms(results)
    if system == "padded":
        extra["mean_batch_size_note"] = "rows per decoding step, padding rows included"
    else:
        extra["mean_batch_size_note"] = "not reported by transformers' continuous batching"
    extra["engine_overhead_pct"] = None  # no step counters in-process
    return run, extra


def run_one(cfg: SuiteConfig, system: str, phase: str, rate: float) -> tuple[dict, dict]:
    name = f"{system}/{phase}"
    started = time.monotonic()
    print(f"\n== {name} (request rate {rate:g}/s)", file=sys.stderr, flush=True)
    try:
        if system == "tpserve-continuous":
            run, extra = run_tpserve(cfg, name, rate, ("--batching", "continuous"))
        elif system == "tpserve-static":
            flags = ("--batching", "static", "--static-batch-size", str(cfg.static_batch_size))
            run, extra = run_tpserve(cfg, name, rate, flags)
        else:
            run, extra = run_baseline(cfg, name, rate, system.removeprefix("hf-"))
    except Exception as e:  # one system failing must not lose the others' figures
        run = summarize(name, cfg.spec.name, [])
        extra = {"error": f"{type(e).__name__}: {e}"}
    extra["request_rate"] = "inf" if math.isinf(rate) else rate
    extra["wall_s"] = time.monotonic() - started
    print(f"== {name}: {extra.get('error') or 'done'} in {extra['wall_s']:.0f}s", file=sys.stderr, flush=True)
    return run, extra


def poisson_rate(runs: dict[str, dict], details_: dict[str, dict], fraction: float) -> float | None:
    """fraction of static batching's phase-1 request throughput (tpserve static, else transformers padded)."""
    for name in ("tpserve-static/burst", "hf-padded/burst"):
        if name in runs and not details_[name].get("error") and runs[name]["requests_per_s"] > 0:
            return fraction * runs[name]["requests_per_s"]
    return None


def run_suite(cfg: SuiteConfig, checkpoint=None) -> tuple[list[dict], dict[str, dict], dict]:
    """Both phases; checkpoint(runs, details, meta), when given, is called after every run so a long
    suite that is interrupted still leaves what it measured."""
    runs: dict[str, dict] = {}
    extras: dict[str, dict] = {}
    meta = {
        "model": cfg.model,
        "spec": dataclasses.asdict(cfg.spec),
        "num_requests": cfg.num_requests,
        "seed": cfg.seed,
        "static_batch_size": cfg.static_batch_size,
        "poisson_rate": None,
        "rate_fraction_of_static": cfg.rate_fraction,
        "slo_ttft_ms": cfg.slo_ttft_ms,
        "slo_tpot_ms": cfg.slo_tpot_ms,
        "dtype": cfg.dtype,
        "cpu_count": os.cpu_count(),
    }

    def one(system: str, phase: str, rate: float) -> None:
        name = f"{system}/{phase}"
        runs[name], extras[name] = run_one(cfg, system, phase, rate)
        if checkpoint is not None:
            checkpoint(list(runs.values()), extras, meta)

    for system in cfg.systems:
        one(system, "burst", math.inf)
    meta["poisson_rate"] = rate = poisson_rate(runs, extras, cfg.rate_fraction)
    if rate is not None:
        for system in cfg.systems:
            one(system, "poisson", rate)
    return list(runs.values()), extras, meta


def references(runs: list[dict]) -> dict[str, str]:
    """Each run is compared with tpserve continuous in the same phase."""
    return {r["name"]: f"tpserve-continuous/{r['name'].split('/')[1]}" for r in runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__)
    p.add_argument("--model", default=str(ROOT / "models" / "small"))
    add_workload_arguments(p)
    p.add_argument("--static-batch-size", type=int, default=32)
    p.add_argument("--rate-fraction", type=float, default=0.9, help="Poisson rate as a fraction of static's")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}"
    )
    p.add_argument("--launch-timeout", type=float, default=180.0, help="seconds for a stack to serve")
    p.add_argument("--out-dir", default=str(ROOT / "results"))
    a = p.parse_args(argv)
    systems = tuple(s for s in a.systems.split(",") if s)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        print(f"bench.suite: unknown systems {sorted(unknown)}; choose from {SYSTEMS}", file=sys.stderr)
        return 2
    cfg = SuiteConfig(
        model=a.model,
        spec=workload_from_args(a),
        num_requests=a.num_requests,
        seed=a.seed,
        static_batch_size=a.static_batch_size,
        rate_fraction=a.rate_fraction,
        slo_ttft_ms=a.slo_ttft_ms,
        slo_tpot_ms=a.slo_tpot_ms,
        dtype=a.dtype,
        systems=systems,
        launch_timeout_s=a.launch_timeout,
    )
    out = Path(a.out_dir) / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    started = time.monotonic()

    def checkpoint(runs, extras, meta):
        write_json(out.with_suffix(".json"), runs, extras, {**meta, "wall_s": time.monotonic() - started})

    runs, extras, meta = run_suite(cfg, checkpoint)
    meta["wall_s"] = time.monotonic() - started
    write_json(out.with_suffix(".json"), runs, extras, meta)
    plot(out.with_suffix(".png"), runs, extras)
    print()
    print(format_table(runs, extras, references(runs)))
    rate = meta["poisson_rate"]
    print(
        f"poisson phase: {'skipped (no static throughput)' if rate is None else f'{rate:.2f} req/s'}; ",
        end="",
    )
    print(f"suite wall time {meta['wall_s']:.0f}s; wrote {out}.json and {out}.png")
    return 0 if not any(e.get("error") for e in extras.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
