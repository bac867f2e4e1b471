"""Latency objectives: the router's admission estimate (router/slo.py) and the scheduler's slack order
(scheduler/slack.py), with a fake clock and fake replicas."""

from dataclasses import dataclass

import pytest

from common.load import ReplicaLoad
from router.slo import NO_OBJECTIVES, Objectives, SloEstimator, SloPolicy, SloRefused, resolve, ttft_budget_ms
from scheduler.slack import admission_order, slack


def load(running=4, waiting=0, step_s=0.05, max_num_seqs=4) -> ReplicaLoad:
    return ReplicaLoad(
        waiting=waiting,
        running=running,
        kv_blocks_free=100,
        kv_blocks_total=100,
        max_num_seqs=max_num_seqs,
        step_seconds=step_s,
        shards_ready=True,
    )


def measured(first_token_s=0.2, service_s=2.0, replicas=("a",)) -> SloEstimator:
    """An estimator that has seen requests served: first token after first_token_s, done after service_s."""
    est = SloEstimator()
    for r in replicas:
        for i in range(3):
            est.sent(r, f"{r}{i}", NO_OBJECTIVES)
            est.first_token(r, first_token_s)
            est.ended(r, f"{r}{i}", service_s)
    return est


def test_defaults_resolve_per_bucket_and_zero_is_none():
    policy = SloPolicy(slo_ttft_ms=(500, 2000, 8000), slo_tpot_ms=(100,))
    assert resolve(policy, 0, None, None, 0) == Objectives(0.5, 0.1, 0)
    assert resolve(policy, 2, None, None, 3) == Objectives(8.0, 0.1, 3)
    assert resolve(policy, 1, 300, 0, -1) == Objectives(0.3, None, -1)  # the request's own win
    assert resolve(SloPolicy(), 0, None, None, 0) == NO_OBJECTIVES
    with pytest.raises(ValueError, match="--slo-ttft-ms takes one value or one per length bucket"):
        SloPolicy(slo_ttft_ms=(1, 2)).check(3)


def test_admitted_when_the_queue_drains_in_time():
    # 4 slots, 2 s a request: 2 requests a second. 1 ahead, no free slot: (1 + 1) / 2 = 1 s + 0.2 s.
    est = measured()
    ttft, wait = est.predict_ttft({"a": load()}, ahead=1, free_slots=0)
    assert wait == pytest.approx(1.0) and ttft == pytest.approx(1.2)
    est.check(Objectives(ttft_s=1.5), {"a": load()}, ahead=1, free_slots=0)  # no exception: admitted
    # A free slot now: no queue wait at all.
    assert est.predict_ttft({"a": load()}, ahead=0, free_slots=1) == (pytest.approx(0.2), 0.0)


def test_the_queue_drains_at_the_batch_the_replica_runs_not_at_max_num_seqs():
    # 35 running (the TPOT gate holds it there) of 128 allowed, 10 s a request: 3.5 requests a second.
    est = measured(service_s=10.0)
    _, wait = est.predict_ttft({"a": load(running=35, max_num_seqs=128)}, ahead=10, free_slots=0)
    assert wait == pytest.approx(11 / 3.5)  # with max_num_seqs it was 11 / 12.8: 3.7x too short


def test_refused_at_once_when_it_cannot_meet_its_ttft():
    est = measured()
    with pytest.raises(SloRefused, match=r"predicted 5200 ms \(9 requests ahead") as e:
        est.check(Objectives(ttft_s=1.5), {"a": load()}, ahead=9, free_slots=0)
    assert e.value.retry_after_s == 4  # ceil(5.2 - 1.5): when the queue ahead should have drained
    # The scheduler's own waiting sequences are ahead of it too.
    with pytest.raises(SloRefused):
        est.check(Objectives(ttft_s=1.5), {"a": load(waiting=4)}, ahead=0, free_slots=0)
    # A second replica doubles the drain rate: now it fits.
    est2 = measured(replicas=("a", "b"))
    est2.check(Objectives(ttft_s=1.5), {"a": load(), "b": load()}, ahead=1, free_slots=0)


def test_no_objective_or_nothing_measured_is_admitted():
    est = measured()
    est.check(NO_OBJECTIVES, {"a": load()}, ahead=1000, free_slots=0)
    SloEstimator().check(Objectives(ttft_s=0.001), {"a": load()}, ahead=1000, free_slots=0)


def test_a_replica_stepping_past_its_requests_tpot_takes_no_new_ones_until_it_drains():
    est = SloEstimator(SloPolicy())  # margin 0.9
    est.sent("a", "r1", Objectives(tpot_s=0.1))
    est.sent("a", "r2", Objectives(tpot_s=0.5))
    assert est.takes_decode("a", load(step_s=0.08))
    assert not est.takes_decode("a", load(step_s=0.095))  # past 0.9 * the tightest, 0.1 s
    est.ended("a", "r1", 1.0)
    assert est.takes_decode("a", load(step_s=0.095))  # the tight one left: 0.45 s now binds
    est.ended("a", "r2", None)
    assert est.takes_decode("a", load(step_s=5.0))  # holds no objective: open


def test_the_step_is_projected_to_the_batch_the_replica_would_run():
    est = SloEstimator(SloPolicy())  # margin 0.9, fixed 8 sequences' worth
    est.sent("a", "r1", Objectives(tpot_s=0.2))
    # 30 running at 0.15 s: one more makes (30 + 1 + 8) / 38 of it.
    assert est.projected_step(load(running=30, step_s=0.15)) == pytest.approx(0.15 * 39 / 38)
    assert est.takes_decode("a", load(running=30, step_s=0.15), pending=6)  # 0.1776 s
    assert not est.takes_decode("a", load(running=30, step_s=0.15), pending=7)  # 0.1816 s > 0.18 s
    # Those waiting at the scheduler will join the batch too.
    assert not est.takes_decode("a", load(running=30, waiting=7, step_s=0.15))


def test_a_replica_idle_at_its_report_is_projected_from_its_last_measured_step():
    est = SloEstimator(SloPolicy())
    est.sent("a", "r0", Objectives(tpot_s=0.2))
    assert not est.takes_decode("a", load(running=0, step_s=0.25))  # one sequence alone: 0.25 * 9 / 8
    # Its next report comes from an idle moment (no step in flight): 0 s. Those sent since then still
    # count against the step it last measured, not against nothing.
    assert est.projected_step(load(running=0, step_s=0.0), 2, (0.25, 0)) == pytest.approx(0.25 * 11 / 8)
    assert not est.takes_decode("a", load(running=0, step_s=0.0), pending=2)
    assert est.takes_decode("b", load(running=0, step_s=0.0))  # nothing measured there: open


def test_the_gate_learns_how_much_slower_than_the_step_its_requests_see_their_tokens():
    est = SloEstimator(SloPolicy())  # margin 0.9: a 0.2 s objective closes past 0.18 s
    est.sent("a", "held", Objectives(tpot_s=0.2))
    busy = load(running=10, step_s=0.115, max_num_seqs=64)
    assert est.takes_decode("a", busy)  # 0.115 * 19 / 18 = 0.121 s projected
    # Requests decoded while the scheduler reported 0.1 s steps, and saw a token every 0.15 s (the
    # scheduler's own work between steps and the stream are not in its step).
    for i in range(10):
        est.sent("a", f"r{i}", Objectives(tpot_s=0.2))
        est.reported("a", load(running=10, step_s=0.1, max_num_seqs=64), now=10.0 * i)
        est.first_token("a", 0.05, f"r{i}", now=10.0 * i + 1.0)
        est.ended("a", f"r{i}", 2.6, tokens=11, now=10.0 * i + 2.5)  # 10 intervals in 1.5 s
    assert est.tpot_bias == pytest.approx(1.5)
    assert not est.takes_decode("a", busy)  # 0.121 s x 1.5 = 0.182 s: past 0.18 s now
    assert est.takes_decode("a", load(running=10, step_s=0.1, max_num_seqs=64))  # 0.158 s


def test_a_request_without_a_tpot_objective_or_that_failed_teaches_the_gate_nothing():
    est = SloEstimator(SloPolicy())
    est.sent("a", "free", NO_OBJECTIVES)
    est.sent("a", "failed", Objectives(tpot_s=0.2))
    est.reported("a", load(step_s=0.1), now=0.0)
    for rid in ("free", "failed"):
        est.first_token("a", 0.05, rid, now=1.0)
    est.ended("a", "free", 5.0, tokens=11, now=5.0)
    est.ended("a", "failed", None, tokens=11, now=5.0)
    assert est.tpot_bias == 1.0


@dataclass
class Seq:
    name: str
    priority: int = 0
    ttft_deadline: float | None = None
    admitted_before: bool = False
    num_computed_tokens: int = 0
    num_tokens: int = 16
    num_output_tokens: int = 0


def names(seqs, now, step_s=0.1, tokens_per_step=64):
    return [s.name for s in admission_order(seqs, now, step_s, tokens_per_step)]


def test_first_come_first_served_without_priorities_or_objectives():
    seqs = [Seq("a"), Seq("b"), Seq("c")]
    assert names(seqs, 0.0) == ["a", "b", "c"]


def test_priorities_order_the_queue_then_slack():
    seqs = [
        Seq("low", priority=5, ttft_deadline=10.0),
        Seq("high-late", priority=-1, ttft_deadline=20.0),
        Seq("high-soon", priority=-1, ttft_deadline=5.0),
        Seq("high-none", priority=-1),
        Seq("default", priority=0, ttft_deadline=10.0),
    ]
    assert names(seqs, 0.0) == ["high-soon", "high-late", "high-none", "default", "low"]


def test_slack_counts_the_prefill_steps_left():
    s = Seq("a", ttft_deadline=2.0, num_tokens=200, num_computed_tokens=72)  # 128 left: 2 steps of 64
    assert slack(s, 1.0, 0.1, 64) == pytest.approx(0.8)
    assert slack(Seq("b"), 1.0, 0.1, 64) == float("inf")


def test_preempted_sequences_keep_their_place_but_not_before_a_higher_priority_or_an_urgent_one():
    seqs = [
        Seq("new", ttft_deadline=0.5),  # slack 0.4 s: not urgent
        Seq("preempted", admitted_before=True, num_output_tokens=3),
        Seq("new-lower", priority=1),
        Seq("new-higher", priority=-1),  # what may preempt it (scheduler/priority.py) goes first
        Seq("urgent-lowest", priority=5, ttft_deadline=0.15),  # slack 0.05 s < one step
    ]
    assert names(seqs, 0.0) == ["urgent-lowest", "new-higher", "preempted", "new", "new-lower"]


def test_a_deadline_is_for_the_first_token_only():
    out = Seq("first-token-out", ttft_deadline=0.0, num_output_tokens=1)  # past due, but it was met
    assert slack(out, 1.0, 0.1, 64) == float("inf")
    assert names([Seq("plain", priority=-1), out], 1.0) == ["plain", "first-token-out"]


def test_no_starvation_of_an_admitted_request_under_a_stream_of_higher_priority_ones():
    """One slot per step, a new higher-priority request every step: the low-priority one, admitted with a
    1 s TTFT objective, is served before its deadline, and only then do the others go on."""
    step_s = 0.1
    low = Seq("low", priority=1, ttft_deadline=1.0)
    waiting, served_at, now = [low], {}, 0.0
    for i in range(40):
        waiting.append(Seq(f"high{i}", priority=0, ttft_deadline=now + 3.0))
        first = admission_order(waiting, now, step_s, 64)[0]
        waiting.remove(first)
        served_at[first.name] = now
        now += step_s
    assert served_at["low"] + step_s <= low.ttft_deadline  # its first token within its objective
    assert served_at["low"] > 0.5  # and it did wait behind the higher priorities while it could
    # Every higher-priority request served also met its own deadline.
    assert all(
        t + step_s <= i * step_s + 3.0
        for i, t in ((int(n[4:]), t) for n, t in served_at.items() if n != "low")
    )


def test_the_prediction_learns_from_the_ttfts_it_got_wrong():
    est = measured()
    for _ in range(30):  # requests took twice what was predicted for them
        est.observed_ttft(1.0, 2.0)
    ttft, _ = est.predict_ttft({"a": load()}, ahead=1, free_slots=0)
    assert ttft == pytest.approx(2.4, rel=0.01)  # 1.2 s, doubled
    with pytest.raises(SloRefused):
        est.check(Objectives(ttft_s=1.5), {"a": load()}, ahead=1, free_slots=0)
    for _ in range(30):
        est.observed_ttft(1.0, 100.0)  # bounded: one stall does not shut admission for good
    assert est.bias == 4.0


def test_the_prediction_is_scaled_to_cover_nearly_every_request_not_the_average():
    # The promise is each request's: a prediction right on average leaves the late ones past their objective.
    est = measured()
    for i in range(64):  # 63 on time, 1 late by half: under the 0.97 quantile (the 63rd of 64)
        est.observed_ttft(1.0, 1.5 if i == 40 else 1.0)
    assert est.bias == 1.0
    est.observed_ttft(1.0, 1.5)  # a second late one (the window keeps the last 64): now it counts
    assert est.bias == 1.5
    for _ in range(64):  # all on time again: the window forgets the late ones
        est.observed_ttft(1.0, 0.9)
    assert est.bias == pytest.approx(0.9)


def test_the_scheduler_gets_what_is_left_of_the_ttft_objective():
    assert ttft_budget_ms(Objectives(ttft_s=1.0), 0.25) == 750
    assert ttft_budget_ms(Objectives(ttft_s=1.0), 2.0) == 1  # overdue: due at once, never "none"
    assert ttft_budget_ms(NO_OBJECTIVES, 0.25) == 0


def test_a_refusal_is_http_429_with_retry_after():
    import grpc

    from router.frontend import RequestFailed
    from router.openai.errors import from_failure
    from router.openai.server import _error

    failure = RequestFailed(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "cannot meet the TTFT objective", retry_after_s=3
    )
    error = from_failure(failure, {})
    response = _error(error, error.body())
    assert response.status == 429 and response.headers["Retry-After"] == "3"
    assert b"cannot meet the TTFT objective" in response.body


def test_openai_bodies_carry_objectives_and_priority():
    from router.openai.protocol import parse_completion

    body = {"model": "m", "prompt": "hi", "priority": -2, "ttft_objective_ms": 500, "tpot_objective_ms": 0}
    g = parse_completion(body, "id").generates[0]
    assert (g.priority, g.ttft_objective_ms, g.tpot_objective_ms) == (-2, 500, 0)
    assert g.HasField("tpot_objective_ms")  # 0 sent: no objective, not the server's default
    g = parse_completion({"model": "m", "prompt": "hi"}, "id").generates[0]
    assert not g.HasField("ttft_objective_ms") and g.priority == 0


def test_the_scheduler_admits_by_priority_then_deadline():
    from scheduler.block_manager import BlockManager
    from scheduler.scheduler import Scheduler, SchedulingPolicy
    from scheduler.sequence import Sequence

    sched = Scheduler(SchedulingPolicy(max_num_seqs=2, max_model_len=1024), BlockManager(64, 16))
    for i, (priority, deadline) in enumerate([(0, None), (1, 5.0), (-1, None), (0, 2.0)]):
        sched.add(Sequence(i, f"r{i}", [10 + i] * 5, 5, 4, priority=priority, ttft_deadline=deadline))
    out = sched.schedule(now=0.0)
    assert [s.request_id for s in out.admitted] == [
        "r2",
        "r3",
    ]  # priority -1; then priority 0 with a deadline
    assert [s.request_id for s in sched.waiting] == ["r0", "r1"]  # the queue itself keeps arrival order
