"""The serial step loop against --async-scheduling, on one model, servers started one at a time and
alternated (serial, async, serial, async, ...) so that a shared machine's drift falls on both alike.

    python -m bench.async_scheduling [--model models/smollm2] [--rounds 2] [--concurrency 1 8]
    python -m bench.async_scheduling --device-ms 10 [--concurrency 1 8 64]

Each server gets the same greedy requests (random prompt ids, EOS ignored) at each concurrency, with at
most that many in flight: output tokens per second (wall clock), and the scheduler's mean step time
(GetStats). Prints one row per server and concurrency, then each concurrency's async/serial ratio of
the medians. Checks that both loops gave the same tokens.

On CPU the forward and the scheduler share the cores, so overlapping them gains little there. With
--device-ms the real Engine (scheduler, step building and serialization, updates, outputs) drives a
simulated device instead of ranks: each step takes that long after the device is free and the step
has arrived, and nothing of it uses the CPU, as a GPU's forward does not: how much of the scheduler's
host work the async loop hides where the forward is short.
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


class SimulatedDevice:
    """A WorkerGroup whose one rank takes device_s per step, off the CPU; tokens are a function of the
    step and sequence (the same in both loops for the same schedule, which is all this measures)."""

    def __init__(self, device_s: float, num_blocks: int = 8192):
        self.device_s, self.num_blocks = device_s, num_blocks
        self.free_at = 0.0
        self.pending: list[tuple[float, object]] = []

    async def connect(self, on_lost=lambda: None):
        from common.pb.tpserve.internal.v1 import worker_pb2
        from scheduler.capacity import Capacity
        from scheduler.workers import WorkerGroupInfo

        describe = worker_pb2.DescribeResponse(
            rank=0, world_size=1, model_name="sim", vocab_size=1000, max_position_embeddings=4096,
            num_kv_blocks=self.num_blocks,
        )  # fmt: skip
        return WorkerGroupInfo((describe,), Capacity(self.num_blocks, 4096, 0))

    def check(self) -> None:
        pass

    async def send(self, data: bytes) -> None:
        import numpy as np

        from common.pb.tpserve.internal.v1 import worker_pb2

        req = worker_pb2.StepRequest.FromString(data)
        n = int(np.count_nonzero(np.frombuffer(req.sample_counts, "<i8")))
        self.free_at = max(time.perf_counter(), self.free_at) + self.device_s
        reply = worker_pb2.StepResponse(step_id=req.step_id, token_ids=[7] * n, token_counts=[1] * n)
        self.pending.append((self.free_at, reply))

    async def receive(self, step_id: int):
        import asyncio

        done_at, reply = self.pending.pop(0)
        await asyncio.sleep(max(0.0, done_at - time.perf_counter()))
        return [reply]

    async def step(self, data: bytes, step_id: int):
        await self.send(data)
        return await self.receive(step_id)

    async def close(self) -> None:
        pass


async def simulated(async_scheduling: bool, device_s: float, concurrency: int, max_new: int, prompt_len: int):
    """Output tokens per second of the real Engine on SimulatedDevice, concurrency requests at once."""
    import asyncio

    from common.pb.tpserve.internal.v1 import scheduler_pb2
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine
    from scheduler.router_streams import RouterStream

    config = SchedulerConfig(workers=("sim:0",), async_scheduling=async_scheduling, admission_window=512)
    engine, stream = Engine(config, SimulatedDevice(device_s)), RouterStream()
    task = asyncio.create_task(engine.serve_forever())
    await engine.ready.wait()
    engine.attach(stream)
    done: set[str] = set()
    start = time.perf_counter()
    for i in range(concurrency):
        msg = scheduler_pb2.AddRequest(
            request_id=f"r{i}", prompt_token_ids=[5 + i % 7] * prompt_len, max_new_tokens=max_new,
            ignore_eos=True, sampling=pb.SamplingParams(temperature=0),
        )  # fmt: skip
        engine.add(msg, stream)
    while len(done) < concurrency:
        msg = await stream.outbox.get()
        done.update(o.request_id for o in msg.outputs if o.finish_reason or o.error)
    seconds = time.perf_counter() - start
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return concurrency * max_new / seconds, engine.totals.steps


def main_simulated(a) -> None:
    import asyncio

    ratios: dict[int, list[float]] = {}
    for r in range(a.rounds):
        for c in a.concurrency:
            tps = {}
            for mode in ("serial", "async"):
                args = (mode == "async", a.device_ms / 1e3, c, a.max_new, a.prompt_len)
                tps[mode], steps = asyncio.run(simulated(*args))
                step_ms = c * a.max_new / tps[mode] / steps * 1e3
                line = f"round {r} {mode:6s} c={c:<3d} {tps[mode]:8.1f} tok/s  {steps} steps"
                print(f"{line}, {step_ms:.2f} ms/step ({step_ms - a.device_ms:+.2f} ms beside the device)")
            ratios.setdefault(c, []).append(tps["async"] / tps["serial"])
    for c, rs in ratios.items():
        print(f"c={c}: async/serial output tok/s = {statistics.median(rs):.3f} (median of {len(rs)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--flag", action="append", default=[], help="another flag for both servers")
    p.add_argument("--device-ms", type=float, default=0.0, help="a simulated device's step time instead")
    a = p.parse_args()
    if a.device_ms:
        main_simulated(a)
        return
    rng = random.Random(7)
    prompts = {
        c: [[rng.randrange(2, 1000) for _ in range(a.prompt_len)] for _ in range(c * a.requests_per_slot)]
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
