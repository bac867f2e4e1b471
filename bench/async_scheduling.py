"""The serial step loop against --async-scheduling, on one model, servers started one at a time and
alternated (serial, async, serial, async, ...) so that a shared machine's drift falls on both alike.

    python -m bench.async_scheduling [--model models/smollm2] [--rounds 2] [--concurrency 1 8]

Each server gets the same greedy requests (random prompt ids, EOS ignored) at each concurrency, with at
most that many in flight: output tokens per second (wall clock), and the scheduler's mean step time
(GetStats). Prints one row per server and concurrency, then each concurrency's async/serial ratio of
the medians. Checks that both loops gave the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.launcher import running_stack
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc


def load(stub, prompts: list[list[int]], max_new: int, concurrency: int) -> tuple[float, list[list[int]]]:
    """Output tokens per second, and each request's tokens."""

    def one(ids):
        tokens = []
        req = pb.GenerateRequest(
            token_ids=ids, max_new_tokens=max_new, ignore_eos=True, sampling=pb.SamplingParams(temperature=0)
        )
        for resp in stub.Generate(req, timeout=600):
            tokens += resp.token_ids
        return tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(one, prompts))
    return sum(len(t) for t in outs) / (time.perf_counter() - start), outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--flag", action="append", default=[], help="another flag for both servers")
    a = p.parse_args()
    rng = random.Random(7)
    prompts = {
        c: [[rng.randrange(100, 20000) for _ in range(a.prompt_len)] for _ in range(c * a.requests_per_slot)]
        for c in a.concurrency
    }
    rows, tokens = [], {}
    for r in range(a.rounds):
        for mode in ("serial", "async"):
            flags = [*a.flag, *(["--async-scheduling"] if mode == "async" else [])]
            with running_stack(a.model, *flags) as (info, _), grpc.insecure_channel(info["target"]) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                load(stub, prompts[a.concurrency[0]][:1], 4, 1)  # warm-up
                for c in a.concurrency:
                    before = stub.GetStats(pb.StatsRequest())
                    tps, outs = load(stub, prompts[c], a.max_new, c)
                    after = stub.GetStats(pb.StatsRequest())
                    steps = after.num_steps_total - before.num_steps_total
                    step_ms = (after.step_seconds_total - before.step_seconds_total) / max(steps, 1) * 1e3
                    fwd_ms = (
                        (after.forward_seconds_total - before.forward_seconds_total) / max(steps, 1) * 1e3
                    )
                    rows.append((mode, c, tps, step_ms, fwd_ms))
                    print(f"round {r} {mode:6s} c={c:<3d} {tps:7.1f} tok/s  step {step_ms:6.2f} ms  "
                          f"forward {fwd_ms:6.2f} ms", flush=True)  # fmt: skip
                    if tokens.setdefault(c, outs) != outs:
                        print(f"  TOKENS DIFFER from the first server's at c={c}")
    for c in a.concurrency:
        med = {
            m: statistics.median(t for mm, cc, t, _, _ in rows if mm == m and cc == c)
            for m in ("serial", "async")
        }
        print(f"c={c}: async/serial output tok/s (medians) = {med['async'] / med['serial']:.3f}")


if __name__ == "__main__":
    main()
