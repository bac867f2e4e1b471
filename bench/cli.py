"""`tpserve bench`: send a seeded workload to a running server and print (and save) what it measured.

tpserve bench --target HOST:PORT [--workload chat|mixed] [--num-requests N] [--request-rate R|inf]
              [--burstiness B] [--max-concurrency C] [--seed S] [--slo-ttft-ms X] [--slo-tpot-ms Y]
              [--goodput ttft:X tpot:Y]
              [--out FILE.json] [--ready-file F]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path

from bench.workload import WORKLOADS, WorkloadSpec
from common import security


def _rate(text: str) -> float:
    rate = float(text)  # float() takes "inf"
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return rate


def _positive_int(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return n


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload flags, shared with `make bench` (bench.suite)."""
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    p.add_argument(
        "--prompt-min", type=_positive_int, default=None, help="override the workload's prompt range"
    )
    p.add_argument("--prompt-max", type=_positive_int, default=None)
    p.add_argument(
        "--output-mean", type=float, default=None, help="override the exponential output-length mean"
    )
    p.add_argument("--output-max", type=_positive_int, default=None, help="override the output-length cap")
    p.add_argument("--num-requests", type=_positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)


def workload_from_args(a: argparse.Namespace) -> WorkloadSpec:
    """The named workload with any range overridden; raises ValueError on an impossible range."""
    base = WORKLOADS[a.workload]
    overrides = {
        field: getattr(a, field)
        for field in ("prompt_min", "prompt_max", "output_mean", "output_max")
        if getattr(a, field) is not None
    }
    return dataclasses.replace(base, **overrides)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="router HOST:PORT")
    add_workload_arguments(p)
    p.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson), or inf: all at once"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None, help="most requests in flight")
    p.add_argument(
        "--slo-ttft-ms", type=float, default=None, help="goodput counts requests with TTFT under this"
    )
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="... and TPOT under this")
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        default=None,
        help="`vllm bench serve --goodput`'s form of the same: ttft:MS and/or tpot:MS",
    )
    p.add_argument("--timeout", type=float, default=None, help="deadline per request, seconds")
    p.add_argument("--name", default="tpserve", help="the run's name in the table and the JSON")
    p.add_argument(
        "--ready-file", default=None, help="`tpserve launch --ready-file`: report its processes' peak RSS"
    )
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-warmup", action="store_true", help="skip the two short warm-up requests")
    security.add_client_arguments(p)


def main(a: argparse.Namespace) -> int:
    # Imported here, not at the top: every tpserve process builds this module's flags (the CLI's parser),
    # and none but the benchmark should load its client, plotting and progress bar.
    import grpc

    from bench.client_run import bench_server
    from bench.report import format_speculation, format_table, write_json

    try:
        spec = workload_from_args(a)
        apply_goodput(a)
        if a.burstiness <= 0:
            raise ValueError(f"--burstiness must be > 0, got {a.burstiness}")
        pids = json.loads(Path(a.ready_file).read_text())["pids"] if a.ready_file else None
        auth = security.client_from_args(a)
    except (ValueError, OSError, KeyError) as e:
        print(f"tpserve bench: {e}", file=sys.stderr)
        return 2
    try:
        run, extra, _ = asyncio.run(
            bench_server(
                a.target,
                spec,
                a.num_requests,
                name=a.name,
                seed=a.seed,
                request_rate=a.request_rate,
                burstiness=a.burstiness,
                max_concurrency=a.max_concurrency,
                slo_ttft_ms=a.slo_ttft_ms,
                slo_tpot_ms=a.slo_tpot_ms,
                pids=pids,
                progress=not a.no_progress,
                warmup=not a.no_warmup,
                timeout_s=a.timeout,
                auth=auth,
            )
        )
    except (grpc.aio.AioRpcError, RuntimeError) as e:
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
        print(f"tpserve bench: {a.target}: {detail}", file=sys.stderr)
        return 1
    print(format_table([run], {run["name"]: extra}))
    if extra.get("speculation"):
        print(format_speculation(run["name"], extra["speculation"]))
    if extra["failed"]:
        print(
            f"{extra['failed']} of {extra['num_requests']} requests failed: {extra['errors']}",
            file=sys.stderr,
        )
    if a.out:
        args = {k: v for k, v in vars(a).items() if k != "api_key"}  # a secret stays out of the results
        meta = {"target": a.target, "spec": dataclasses.asdict(spec), "args": _jsonable(args)}
        write_json(a.out, [run], {run["name"]: extra}, meta)
    return 0 if extra["failed"] == 0 else 1


def apply_goodput(a: argparse.Namespace) -> None:
    """--goodput ttft:MS tpot:MS (vLLM's) into --slo-ttft-ms / --slo-tpot-ms; ValueError for another key."""
    for item in a.goodput or ():
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot") or not ms:
            raise ValueError(f"--goodput takes ttft:MS and tpot:MS, got {item!r}")
        value = float(ms)
        if not value > 0:
            raise ValueError(f"--goodput {key} must be > 0 ms, got {ms}")
        setattr(a, f"slo_{key}_ms", value)


def _jsonable(d: dict) -> dict:
    return {
        k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items() if not callable(v)
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
