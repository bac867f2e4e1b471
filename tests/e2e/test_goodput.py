"""Goodput under overload (issue 32), on the tiny model: offered three times the rate the stack sustains,
every request with the server's default objectives is either refused at once (RESOURCE_EXHAUSTED naming
the objective) or served within its objectives; none that was admitted fails. And priorities: a request
of higher priority goes before those already queued.

The sustainable rate is measured first, in the same run, after a warm-up (a closed batch without
objectives: requests that send 0 opt out of the server's defaults). Latencies are measured per request
at the client. The overload is a fixed number of requests (3x the sustainable rate times OFFER_S) sent at
Poisson arrival times fixed in advance: a client slowed by the shared cores sends late, in bursts (more
overload), never fewer.

Tolerance. This machine is shared: other processes change the stack's speed by 2x and more within
seconds (measured: 137 tokens/s in the calibration, 270 in the next seconds, then a stall that took an
admitted request to 2.65 s), so a promise made from the speed the server measured when a request arrived
can be broken by a slowdown that is no fault of the server. So each wait is judged against the stack's
own measured speed: the client polls GetStats (the scheduler's steps and their seconds, cumulative)
through the run, and a wait counts its wall time less what the steps run during it took beyond the step
time the stack promised on (its mean step over the 2 s before the request arrived or in the calibration,
whichever is faster: its estimates are moving averages, so a slowdown that began just before a request
arrived is not yet in them). A slowdown of the steps after the promise is forgiven; time the stack spent
idle, or outside its steps, is not (judged by the tokens it produced instead, a stack that idled while
requests waited passed: it produced few). Bounds:
- an admitted request's TTFT: its objective x 1.5 + 250 ms (the estimate is of a queue with a crude
  model of its service);
- its TPOT: 2x its objective, judged the same way over its decode;
- a refusal: 1 s from the call (the router answers before queuing).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.stack_clock import StackClock

TOKENS = 32
TTFT_MS, TPOT_MS = 1000, 250
# Aging (--max-queue-wait-ms) is out of the way: on a slow machine the priority test's queued requests
# would be overdue, and go first, before the slot it waits for frees (the goodput test is one FIFO anyway).
FLAGS = (
    "--max-num-seqs", "2", "--admission-window", "2", "--max-queue-wait-ms", "600000",
    "--slo-ttft-ms", str(TTFT_MS), "--slo-tpot-ms", str(TPOT_MS),
)  # fmt: skip
TTFT_TOLERANCE_S = TTFT_MS / 1000 * 1.5 + 0.25
TPOT_TOLERANCE_S = TPOT_MS / 1000 * 2
REFUSED_WITHIN_S = 1.0
OVERLOAD = 3.0
OFFER_S = 6.0


@pytest.fixture(scope="module")
def stack(tiny_model):
    with launch(tiny_model, *FLAGS) as (target, _):
        yield target


async def one(
    stub, i: int, objectives: bool, priority: int = 0, started: asyncio.Event | None = None, tokens=TOKENS
) -> dict:
    request = pb.GenerateRequest(
        token_ids=[5 + i % 50, 7, 9], max_new_tokens=tokens, ignore_eos=True, priority=priority
    )
    if not objectives:
        request.ttft_objective_ms = 0
        request.tpot_objective_ms = 0
    start = time.perf_counter()
    times = []
    try:
        async for resp in stub.Generate(request, timeout=120):
            times += [time.perf_counter()] * len(resp.token_ids)
            if started is not None:
                started.set()
    except grpc.aio.AioRpcError as e:
        after = time.perf_counter() - start
        return {"code": e.code().name, "detail": e.details(), "start": start, "after": after}
    ttft = times[0] - start
    tpot = (times[-1] - times[0]) / (len(times) - 1)
    return {"code": "OK", "tokens": len(times), "start": start, "times": times, "ttft": ttft, "tpot": tpot}


async def overload(target: str) -> tuple[float, float, list[dict]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # A warm-up batch (the first steps of each shape compile), then what the stack sustains: a closed
        # batch of 32 requests, no objectives.
        await asyncio.gather(*(one(stub, i, objectives=False) for i in range(8)))
        clock = StackClock()
        await clock.sample(stub)
        start = time.perf_counter()
        calib = await asyncio.gather(*(one(stub, i, objectives=False) for i in range(32)))
        elapsed = time.perf_counter() - start
        await clock.sample(stub)
        assert all(r["code"] == "OK" for r in calib), calib
        steps, seconds = clock.between(start, time.perf_counter())
        sustained, calib_step = len(calib) / elapsed, seconds / steps
        # Three times that, Poisson arrivals fixed in advance, each with the server's default objectives.
        rate, rng = OVERLOAD * sustained, random.Random(0)
        arrivals = [rng.expovariate(rate) for _ in range(math.ceil(rate * OFFER_S))]
        t0, at, tasks = time.perf_counter(), 0.0, []
        sampling = asyncio.ensure_future(clock.run(stub))
        try:
            for gap in arrivals:
                at += gap
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                tasks.append(asyncio.ensure_future(one(stub, len(tasks), objectives=True)))
            results = await asyncio.gather(*tasks)
            await clock.sample(stub)
        finally:
            sampling.cancel()
        return sustained, calib_step, clock, results


def test_at_three_times_the_sustainable_load_requests_are_refused_at_once_or_served_in_time(stack):
    sustained, calib_step, clock, results = asyncio.run(overload(stack))
    counts = Counter(r["code"] for r in results)
    served = [r for r in results if r["code"] == "OK"]
    refused = [r for r in results if r["code"] == "RESOURCE_EXHAUSTED"]

    def promised_step(start: float) -> float:
        """The step time the stack ran at when the request arrived: its mean over the 2 s before, or the
        calibration's, the faster (the router's estimates move slowly, EWMAs, so a promise made just
        after a slowdown began still rests on the speed before it)."""
        recent = clock.mean_step(max(clock.at[0], start - 2.0), start)
        return calib_step if recent is None else min(calib_step, recent)

    def work_s(start: float, end: float) -> float:
        return clock.work_s(start, end, promised_step(start))

    def within(wall_s: float, start: float, bound_s: float) -> bool:
        return work_s(start, start + wall_s) <= bound_s

    def tpot_work(r: dict) -> float:
        return work_s(r["times"][0], r["times"][-1]) / (len(r["times"]) - 1)

    ttft = max((r["ttft"] for r in served), default=0)
    ttft_work = max((work_s(r["start"], r["times"][0]) for r in served), default=0)
    summary = (
        f"sustained {sustained:.1f} req/s (step {calib_step * 1000:.1f} ms), offered {len(results)} in "
        f"about {OFFER_S:.0f} s: {dict(counts)}; served TTFT max {ttft:.3f} s (judged {ttft_work:.3f} s), "
        f"TPOT max {max((r['tpot'] for r in served), default=0):.3f} s "
        f"(judged {max((tpot_work(r) for r in served), default=0):.3f} s); "
        f"refused after at most {max((r['after'] for r in refused), default=0):.3f} s"
    )
    print(summary)
    assert set(counts) <= {"OK", "RESOURCE_EXHAUSTED"}, summary  # none admitted fails
    assert served and refused, summary  # past capacity some are refused, and the rest still served
    for r in refused:
        assert "cannot meet the TTFT objective" in r["detail"] and f"> {TTFT_MS} ms" in r["detail"], r
        assert within(r["after"], r["start"], REFUSED_WITHIN_S), (r, summary)
    for r in served:
        assert r["tokens"] == TOKENS, r
        assert within(r["ttft"], r["start"], TTFT_TOLERANCE_S), ({k: r[k] for k in ("ttft", "tpot")}, summary)
        assert tpot_work(r) <= TPOT_TOLERANCE_S, ({k: r[k] for k in ("ttft", "tpot")}, summary)


async def behind_a_queue(target: str, lows: int) -> tuple[list[dict], dict]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # Sent together, they reach the router in any order: the high one goes once any of them runs.
        started = asyncio.Event()
        sent = [one(stub, i, False, priority=1, started=started, tokens=LOW_TOKENS) for i in range(lows)]
        low = asyncio.gather(*sent)
        await started.wait()
        high = await one(stub, lows, objectives=False, priority=0)
        return await low, high


# A low request's tokens: the margin the priority test leaves for the high one's way in. The client sends
# it once it sees a low one's first token; on a loaded machine (make test's parallel workers) it once saw
# that token late, in a burst with the 63 after it (all received within 12 ms): with 64 tokens the running
# ones had ended before the high one was sent, and nothing was left to preempt.
LOW_TOKENS = 8 * TOKENS


def test_a_higher_priority_goes_before_the_queue_and_preempts_a_running_one(stack):
    """Ordering, not timing. Six requests of priority 1, LOW_TOKENS each: two run (--max-num-seqs 2), the
    router holds the rest. One of priority 0 sent once one of them has its first token goes before every
    queued one, and gets its first token before either running one ends: it took a running one's place
    (the router's credit counts places of lower priority, the scheduler preempts). Margin: the tokens
    left to the running ones, for the client to see the first one and the round trip router -> scheduler."""
    lows, high = asyncio.run(behind_a_queue(stack, lows=6))
    assert all(r["code"] == "OK" for r in (*lows, high)) and all(r["tokens"] == LOW_TOKENS for r in lows)
    by_start = sorted(lows, key=lambda r: r["times"][0])
    running, queued = by_start[:2], by_start[2:]
    firsts = [round(r["times"][0] - high["times"][0], 3) for r in by_start]  # seconds after the high's
    assert all(r["times"][0] > high["times"][0] for r in queued), firsts
    assert high["times"][0] < min(r["times"][-1] for r in running), firsts
