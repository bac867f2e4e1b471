"""Admission and fairness, the three scenarios of issue 39, each on a freshly launched stack:

- burst: a fresh stack, --num-requests (64) sent evenly over --burst-s (8 s), every one with TTFT and
  TPOT objectives: how many were refused, served, and served within both (wall time, at the client);
- hostile: one gRPC request with tpot_objective_ms 1 and priority -1000 asking --hostile-tokens, then six
  ordinary ones half a second later: the hostile one's outcome, and the ordinary ones' first tokens;
- routers: a second `tpserve router --scheduler` in front of the same scheduler (--max-num-seqs 4):
  router A gets 24 requests, router B two more a second later: B's first tokens against A's.

    python -m bench.admission --model models/tiny [--scenarios burst,hostile,routers]

Only public APIs and flags that predate issue 39, so that the same script measures the code before it
(run it with PYTHONPATH pointing at that checkout). Wall-clock figures on a shared CPU are noisy: compare
within one run, on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from common.grpc_util import read_port_file
from common.launcher import running_stack
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc


async def one(stub, request: pb.GenerateRequest, delay: float = 0.0) -> dict:
    await asyncio.sleep(delay)
    start, times = time.perf_counter(), []
    try:
        async for resp in stub.Generate(request, timeout=600):
            times += [time.perf_counter()] * len(resp.token_ids)
    except grpc.aio.AioRpcError as e:
        return {
            "code": e.code().name,
            "detail": e.details()[:160],
            "start": start,
            "end": time.perf_counter(),
        }
    out = {"code": "OK", "start": start, "end": times[-1], "ttft": times[0] - start, "tokens": len(times)}
    out["tpot"] = (times[-1] - times[0]) / max(1, len(times) - 1)
    return out


def request(i: int, tokens: int, prompt: int = 16, **kw) -> pb.GenerateRequest:
    ids = [5 + (i * 7 + j) % 90 for j in range(prompt)]
    return pb.GenerateRequest(token_ids=ids, max_new_tokens=tokens, ignore_eos=True, **kw)


def _q(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


async def burst(target: str, a) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        asks = dict(ttft_objective_ms=a.ttft_ms, tpot_objective_ms=a.tpot_ms)
        gap = a.burst_s / a.num_requests
        rs = await asyncio.gather(
            *(one(stub, request(i, a.tokens, a.prompt, **asks), i * gap) for i in range(a.num_requests))
        )
    served = [r for r in rs if r["code"] == "OK"]
    within = [r for r in served if r["ttft"] <= a.ttft_ms / 1000 and r["tpot"] <= a.tpot_ms / 1000]
    refused = [r for r in rs if r["code"] == "RESOURCE_EXHAUSTED"]
    failed = [r for r in rs if r["code"] not in ("OK", "RESOURCE_EXHAUSTED")]
    return {
        "served": len(served),
        "refused": len(refused),
        "failed": dict(Counter(r["code"] for r in failed)),
        "failed_detail": failed[0]["detail"] if failed else "",
        "within_objectives": len(within),
        "ttft_p50_s": _q([r["ttft"] for r in served], 0.5),
        "ttft_max_s": _q([r["ttft"] for r in served], 1.0),
        "tpot_p50_s": _q([r["tpot"] for r in served], 0.5),
        "tpot_max_s": _q([r["tpot"] for r in served], 1.0),
        "refused_after_max_s": _q([r["end"] - r["start"] for r in refused], 1.0),
    }


async def hostile(target: str, a) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        bad = asyncio.ensure_future(
            one(stub, request(0, a.hostile_tokens, tpot_objective_ms=1, priority=-1000))
        )
        others = await asyncio.gather(*(one(stub, request(i, 16), 0.5) for i in range(1, 7)))
        bad = await bad
    ttfts = [r["ttft"] for r in others if r["code"] == "OK"]
    return {
        "hostile": bad["code"] + (f" after {bad['end'] - bad['start']:.2f}s" if bad["code"] == "OK" else ""),
        "hostile_detail": bad.get("detail", ""),
        "ordinary_ok": len(ttfts),
        "ordinary_ttft_s": [round(t, 3) for t in sorted(ttfts)],
    }


def second_router(model: str, scheduler: str) -> tuple[str, subprocess.Popen]:
    port_file = Path(tempfile.gettempdir()) / f"bench-router-b-{os.getpid()}.port"
    cmd = [sys.executable, "-m", "common.cli", "--log-level", "WARNING", "router", "--model", model]
    proc = subprocess.Popen([*cmd, "--scheduler", scheduler, "--port", "0", "--port-file", str(port_file)])
    try:
        port = read_port_file(port_file, 120, lambda: proc.poll() is None)["port"]
    finally:
        port_file.unlink(missing_ok=True)
    return f"127.0.0.1:{port}", proc


async def routers(a_target: str, b_target: str, a) -> dict:
    async with grpc.aio.insecure_channel(a_target) as ca, grpc.aio.insecure_channel(b_target) as cb:
        stub_a, stub_b = generation_pb2_grpc.GenerationStub(ca), generation_pb2_grpc.GenerationStub(cb)
        await one(stub_b, request(99, 2))  # B is connected and serving before the measurement starts
        long = asyncio.gather(*(one(stub_a, request(i, a.tokens)) for i in range(24)))
        short = asyncio.gather(*(one(stub_b, request(i, a.tokens), 1.0) for i in range(2)))
        long, short = await long, await short
    t0 = min(r["start"] for r in long)
    return {
        "b_first_token_s": [round(r["start"] - t0 + r["ttft"], 2) for r in short],
        "a_first_token_s": [
            round(_q([r["start"] - t0 + r["ttft"] for r in long], q), 2) for q in (0, 0.5, 1)
        ],
        "a_started_before_b": [
            sum(1 for x in long if x["start"] + x["ttft"] < r["start"] + r["ttft"]) for r in short
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__)
    p.add_argument("--model", default="models/tiny")
    p.add_argument("--scenarios", default="burst,hostile,routers")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--burst-s", type=float, default=8.0)
    p.add_argument("--ttft-ms", type=int, default=1500)
    p.add_argument("--tpot-ms", type=int, default=150)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the burst's requests")
    p.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("--hostile-tokens", type=int, default=1000)
    p.add_argument("--burst-flags", default="", help="extra launch flags for the burst, space-separated")
    a = p.parse_args(argv)
    scenarios = a.scenarios.split(",")
    out = {}
    if "burst" in scenarios:
        with running_stack(a.model, *a.burst_flags.split(), timeout_s=600) as (info, _):
            out["burst"] = asyncio.run(burst(info["target"], a))
        print(json.dumps({"burst": out["burst"]}), flush=True)
    if "hostile" in scenarios:
        with running_stack(a.model, timeout_s=600) as (info, _):
            out["hostile"] = asyncio.run(hostile(info["target"], a))
        print(json.dumps({"hostile": out["hostile"]}), flush=True)
    if "routers" in scenarios:
        with running_stack(a.model, "--max-num-seqs", "4", timeout_s=600) as (info, _):
            b, proc = second_router(a.model, info["scheduler"])
            try:
                out["routers"] = asyncio.run(routers(info["target"], b, a))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        print(json.dumps({"routers": out["routers"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
