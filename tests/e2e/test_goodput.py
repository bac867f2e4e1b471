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
can be broken by a slowdown that is no fault of the server. So each wait is measured twice: in wall
time, and in work: the tokens the stack produced for all streams during the wait, divided by its token
rate over the 2 s before the request arrived or its rate in the calibration, whichever is faster (the
speed it promised on: its estimates are moving averages, so a slowdown that began just before a request
arrived is not yet in them; measured once: an admitted request at 2.82 s while the suite's other worker
loaded the cores). A slowdown after the promise lengthens the first, not the
second. A wait passes if either is within its bound:
- an admitted request's TTFT: its objective x 1.5 + 250 ms (the estimate is of a queue with a crude
  model of its service);
- a refusal: 1 s from the call (the router answers before queuing);
and, whatever the work says, within 4x that bound in wall time (a stack that idles while requests wait
does no work, and must not pass on that). TPOT in wall time only: 2x its objective (the tiny model's
steps are a small part of it).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from bisect import bisect_left, bisect_right
from collections import Counter

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch

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
WALL_BACKSTOP = 4.0
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
        start = time.perf_counter()
        calib = await asyncio.gather(*(one(stub, i, objectives=False) for i in range(32)))
        elapsed = time.perf_counter() - start
        assert all(r["code"] == "OK" for r in calib), calib
        sustained, token_rate = len(calib) / elapsed, sum(r["tokens"] for r in calib) / elapsed
        # Three times that, Poisson arrivals fixed in advance, each with the server's default objectives.
        rate, rng = OVERLOAD * sustained, random.Random(0)
        arrivals = [rng.expovariate(rate) for _ in range(math.ceil(rate * OFFER_S))]
        t0, at, tasks = time.perf_counter(), 0.0, []
        for gap in arrivals:
            at += gap
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(stub, len(tasks), objectives=True)))
        return sustained, token_rate, await asyncio.gather(*tasks)


def test_at_three_times_the_sustainable_load_requests_are_refused_at_once_or_served_in_time(stack):
    sustained, token_rate, results = asyncio.run(overload(stack))
    counts = Counter(r["code"] for r in results)
    served = [r for r in results if r["code"] == "OK"]
    refused = [r for r in results if r["code"] == "RESOURCE_EXHAUSTED"]
    produced = sorted(t for r in served for t in r["times"])
    t0 = min(r["start"] for r in results)

    def tokens(start: float, end: float) -> int:
        return bisect_left(produced, end) - bisect_right(produced, start)

    def work_s(start: float, end: float) -> float:
        """The stack's output between start and end in seconds at the speed it had before start."""
        since = max(t0, start - 2.0)
        recent = tokens(since, start) / (start - since) if start - since >= 0.5 else 0.0
        # The faster of the two: the router's estimate moves slowly (EWMAs), so a promise made just after
        # a slowdown began still rests on the speed before it.
        return tokens(start, end) / max(recent, token_rate, 1e-9)

    def within(wall_s: float, start: float, bound_s: float) -> bool:
        return wall_s <= WALL_BACKSTOP * bound_s and min(wall_s, work_s(start, start + wall_s)) <= bound_s

    ttft = max((r["ttft"] for r in served), default=0)
    ttft_work = max((work_s(r["start"], r["times"][0]) for r in served), default=0)
    summary = (
        f"sustained {sustained:.1f} req/s ({token_rate:.0f} tokens/s), offered {len(results)} in about "
        f"{OFFER_S:.0f} s: {dict(counts)}; served TTFT max {ttft:.3f} s (in work {ttft_work:.3f} s), "
        f"TPOT max {max((r['tpot'] for r in served), default=0):.3f} s; "
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
        assert r["tpot"] <= TPOT_TOLERANCE_S, ({k: r[k] for k in ("ttft", "tpot")}, summary)


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
