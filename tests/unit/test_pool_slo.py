"""The router's pool with a replica closed by the TPOT gate (router/slo.py takes_decode): what waits in its
queue is offered again as soon as the gate can open, whether or not a credit message follows. A fake
link stands in for the scheduler's stream; the pool, its queue, replica set and estimator are real."""

from __future__ import annotations

from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.v1 import generation_pb2
from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_LENGTH
from router.buckets import AdmissionQueue, Credits
from router.pool import SchedulerPool
from router.replicas import RoutingPolicy
from router.slo import Objectives

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


def test_a_request_held_by_the_tpot_gate_goes_when_the_replica_reports_a_faster_step():
    pool, link = held()
    load(pool, link, running=1, step_s=0.1)  # within the objective again
    assert link.sent == ["r1", "r2"]


def test_a_request_the_router_ends_itself_opens_the_gate_too():
    pool, link = held()
    pool.done("r1")  # the frontend saw it finish
    assert link.sent == ["r1", "r2"]
