"""Load with faults: requests at a steady rate while a random scheduler or shard worker is SIGKILLed at
intervals, then the outcome of every request and whether every KV block came back.

    python -m bench.chaos --model models/small [--duration 300] [--rate 10] [--kill-every 30]
                          [--replicas 1] [--tp 1] [--seed 0] [--out results/chaos.json]

Runs `tpserve launch --max-restarts 100` itself, so a killed process comes back on its port. Each request
is a short chat-like prompt with a seeded random output length (ignore_eos), sent with Poisson arrivals.
A request counts as completed only if it streamed exactly its max_new_tokens tokens and ended with
FINISH_REASON_LENGTH; anything else is counted by its status code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import grpc

from common.client import AsyncGenerationClient
from common.launcher import running_stack
from common.pb.tpserve.v1 import generation_pb2 as pb


async def one_request(client: AsyncGenerationClient, rng: random.Random, vocab: int) -> tuple[str, float]:
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 64))]
    max_new = min(64, max(1, int(rng.expovariate(1 / 24))))
    start = time.monotonic()
    received = 0
    reason = pb.FINISH_REASON_UNSPECIFIED
    try:
        async for resp in client.generate(
            token_ids=prompt,
            max_new_tokens=max_new,
            ignore_eos=True,
            temperature=1.0,
            seed=rng.randrange(1 << 30),
        ):
            received += len(resp.token_ids)
            reason = resp.finish_reason or reason
    except grpc.aio.AioRpcError as e:
        return e.code().name, time.monotonic() - start
    ok = received == max_new and reason == pb.FINISH_REASON_LENGTH
    return ("COMPLETED" if ok else f"WRONG ({received}/{max_new} tokens)"), time.monotonic() - start


async def run(a: argparse.Namespace, info: dict) -> dict:
    rng = random.Random(a.seed)
    kills: list[dict] = []
    async with AsyncGenerationClient(info["target"], timeout=600) as client:
        vocab = (await client.model_info()).vocab_size
        tasks: list[asyncio.Task] = []
        start = time.monotonic()
        next_kill = start + a.kill_every
        next_send = start
        while time.monotonic() - start < a.duration:
            now = time.monotonic()
            if now >= next_kill:
                pids = json.loads(Path(info["ready_file"]).read_text())["pids"]
                victim = rng.choice(sorted(n for n in pids if n != "router"))
                os.kill(pids[victim], signal.SIGKILL)
                kills.append({"at_s": round(now - start, 1), "victim": victim})
                print(f"[chaos] {now - start:6.1f}s killed {victim} (pid {pids[victim]})", flush=True)
                next_kill += a.kill_every
            if now >= next_send:
                tasks.append(asyncio.create_task(one_request(client, random.Random(rng.random()), vocab)))
                next_send += rng.expovariate(a.rate)
            await asyncio.sleep(max(0.0, min(next_send, next_kill) - time.monotonic()))
        results = await asyncio.gather(*tasks)
        # Every block back once the load is gone (a scheduler may still be coming back: wait for it).
        deadline = time.monotonic() + 120
        stats = None
        while time.monotonic() < deadline:
            try:
                stats = await client.stats()
                if stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0:
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    outcomes = Counter(code for code, _ in results)
    return {
        "requests": len(results),
        "outcomes": dict(outcomes),
        "slowest_s": round(max((s for _, s in results), default=0.0), 2),
        "kills": kills,
        "kv_blocks_free": None if stats is None else stats.kv_blocks_free,
        "kv_blocks_total": None if stats is None else stats.kv_blocks_total,
        "resumed": None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second (Poisson)")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the summary JSON here")
    a = p.parse_args()
    flags = ("--max-restarts", "100", "--replicas", str(a.replicas), "--tp", str(a.tp), "--metrics-port", "0")
    with running_stack(a.model, *flags, log_level="WARNING") as (info, _):
        summary = asyncio.run(run(a, info))
        metrics_port = info["metrics_ports"].get("router")
        if metrics_port:
            from urllib.request import urlopen

            text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            for line in text.splitlines():
                if line.startswith("tpserve_requests_resumed_total"):
                    summary["resumed"] = float(line.split()[-1])
    summary.update(model=a.model, duration_s=a.duration, rate=a.rate, kill_every_s=a.kill_every)
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
