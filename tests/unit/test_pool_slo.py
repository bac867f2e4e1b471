"""The router's pool with a replica closed by the TPOT gate (router/slo.py takes_decode): what waits in its
queue is offered again as soon as the gate can open, whether or not a credit message follows. A fake
link stands in for the scheduler's stream; the pool, its queue, replica set and estimator are real."""

from __future__ import annotations

import pytest

from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.v1 import generation_pb2
from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_LENGTH
from router.buckets import AdmissionQueue, Credits
from router.pool import SchedulerPool
from router.replicas import RoutingPolicy
from router.slo import Objectives, SloRefused

TPOT = Objectives(tpot_s=0.2)  # the gate closes past 0.9 x 0.2 s per step


class FakeLink:
    def __init__(self, target: str, window: int):
        self.target, self.connected, self.credits = target, True, Credits()
        self.credits.update(window, 0)
        self.model_info = generation_pb2.ModelInfo(
            model_name="m", vocab_size=100, max_model_len=512, block_size=16
        )
        self.sent: list[str] = []

    def send(self, add) -> None:
        self.sent.append(add.request_id)

    def abort(self, request_id: str) -> None:
        pass

    def report_queued(self, share: int, best_priority) -> None:
        pass


def stack(window: int = 4):
    policy = RoutingPolicy(routing_policy="least_loaded")
    pool = SchedulerPool(AdmissionQueue(), policy, lambda ready: None, schedulers=("a",))
    link = FakeLink("a", window)
    pool.links["a"] = link
    pool.replicas.add("a")
    return pool, link


def load(pool, link, running: int, step_s: float) -> None:
    msg = scheduler_pb2.LoadReport(
        running=running,
        kv_blocks_free=64,
        kv_blocks_total=64,
        max_num_seqs=8,
        step_seconds=step_s,
        shards_ready=True,
        adds_received=link.credits.sent,
    )
    pool.on_load(link, msg)


def add(request_id: str) -> scheduler_pb2.AddRequest:
    return scheduler_pb2.AddRequest(request_id=request_id, prompt_token_ids=[1, 2, 3])


def held():
    """r1 runs on a replica whose steps became too slow for its TPOT objective; r2 waits in the queue."""
    pool, link = stack()
    load(pool, link, running=0, step_s=0.0)
    pool.submit(add("r1"), TPOT)
    load(pool, link, running=1, step_s=0.5)  # slower than r1's objective allows: closed to new ones
    pool.submit(add("r2"), TPOT)
    assert link.sent == ["r1"]
    return pool, link


def test_a_request_held_by_the_tpot_gate_goes_when_the_slow_replica_finishes_its_requests():
    pool, link = held()
    # r1 ends; the credit window is unchanged (it had room all along), so no credit message comes.
    pool.on_output(
        link, scheduler_pb2.RequestOutput(request_id="r1", token_ids=[7], finish_reason=FINISH_REASON_LENGTH)
    )
    assert link.sent == ["r1", "r2"]


def test_a_request_held_by_the_tpot_gate_goes_when_the_replica_reports_faster_steps():
    pool, link = held()
    # Within the objective again. The gate trusts the recent reports' average, not one fast report (a
    # queue always waiting would take every lucky dip), so it opens after several: from 5x slower, 9
    # reports (4.5 s, the EWMA of step per sequence at weight 0.2 coming down to the objective), no fewer.
    reports = 0
    while link.sent == ["r1"] and reports < 12:
        load(pool, link, running=1, step_s=0.1)
        reports += 1
    assert link.sent == ["r1", "r2"] and reports == 9


def test_a_request_the_router_ends_itself_opens_the_gate_too():
    pool, link = held()
    pool.done("r1")  # the frontend saw it finish
    assert link.sent == ["r1", "r2"]


def slow_spell(pool) -> None:
    """The estimator saw one slow spell (a start-up, a busy neighbour): first token 8 s after sending."""
    pool.slo.sent("a", "old", Objectives())
    pool.slo.first_token("a", 8.0)
    pool.slo.ended("a", "old", 10.0)


def test_a_request_that_would_start_at_once_is_admitted_whatever_a_stale_estimate_says():
    """Refusing it cannot serve it sooner, and only admitted requests refresh the estimate: refused, every
    later request would be refused for ever (measured: a server whose first four requests took 8 s to
    their first token refused all 256 that followed, at any rate)."""
    pool, link = stack(window=1)
    load(pool, link, running=0, step_s=0.05)
    slow_spell(pool)
    pool.submit(add("r1"), Objectives(ttft_s=2.0))
    assert link.sent == ["r1"]
    assert pool._requests["r1"].predicted_ttft is None  # a probe: it does not teach the bias
    # The next one would queue behind r1 (no credit left): the estimate applies, and says it would miss.
    with pytest.raises(SloRefused, match="cannot meet the TTFT objective"):
        pool.submit(add("r2"), Objectives(ttft_s=2.0))


def test_room_on_a_replica_closed_by_the_tpot_gate_is_not_room_to_start_at_once():
    pool, link = held()  # r1 holds the replica closed; r2 waits for it
    slow_spell(pool)
    with pytest.raises(SloRefused):
        pool.submit(add("r3"), Objectives(ttft_s=2.0, tpot_s=0.2))


def test_a_burst_on_one_report_stops_where_the_projected_step_would_pass_the_objective():
    """Before the projection every queued request went on one report whose step was within the objective
    (measured: admitted requests' TPOT p50 226 ms against 200 ms at twice the sustainable rate)."""
    pool, link = stack(window=16)
    load(pool, link, running=0, step_s=0.0)
    pool.submit(add("r0"), TPOT)
    load(pool, link, running=8, step_s=0.15)  # within 0.9 x 0.2 s now
    for i in range(1, 11):
        pool.submit(add(f"r{i}"), TPOT)
    # 0.15 s x (8 running + p pending + 1 + 8 fixed) / (8 + 8) <= 0.18 s for p = 0, 1, 2
    assert link.sent == ["r0", "r1", "r2", "r3"]
    # The next report: faster per sequence, room for one more. The step per sequence's EWMA is
    # 0.8 x 0.15 / 16 + 0.2 x 0.1 / 20 = 0.0085 s, and 0.0085 s x (12 running + p + 1 + 8) <= 0.18 s for
    # p = 0 only.
    load(pool, link, running=12, step_s=0.1)
    assert link.sent == ["r0", "r1", "r2", "r3", "r4"]
