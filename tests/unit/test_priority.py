"""Priority preemption in the scheduler (scheduler/priority.py), as plain Python: no torch, no gRPC.

A waiting request of strictly higher priority (lower value, vLLM's sense) that finds the batch full takes
the place of the lowest-priority running one (the latest admitted among equals), which resumes later by
recompute or swap with the same output; an equal or lower priority never preempts. The fake worker of
test_swap.py checks every context read back through the block tables, so a wrong resume shows."""

from dataclasses import dataclass

import pytest

from scheduler.batch import StepBuilder
from scheduler.priority import victim
from tests.unit.test_scheduler import seq
from tests.unit.test_slo import Seq as SloSeq
from tests.unit.test_swap import FakeWorker, make


def drive(sched, arrivals, num_host_blocks=0):
    """Runs to completion, adding arrivals[i] before step i. Returns (outputs, steps, step each request
    produced its last token at)."""
    worker, builder = FakeWorker(sched.blocks.num_blocks, num_host_blocks), StepBuilder()
    seqs_by_id, outputs, steps, done_at = {}, {}, [], {}
    while sched.has_unfinished or len(steps) <= max(arrivals):
        for s in arrivals.get(len(steps), []):
            sched.add(s)
            seqs_by_id[s.seq_id] = s
        out = sched.schedule()
        assert not (out.swap_out and out.swap_in)
        steps.append(out)
        for u in sched.update(out, worker.step(builder.build(out), seqs_by_id)):
            outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
            if u.finished:
                done_at[u.seq.request_id] = len(steps) - 1
        sched.check_invariants()
        assert len(steps) < 1000
    return outputs, steps, done_at


def two_low_then(newcomer_priority, max_num_seqs=2, num_host_blocks=None):
    sched = make(64, num_host_blocks, max_num_seqs=max_num_seqs)
    lows = [seq(0, 20, max_new=30, priority=1), seq(1, 21, max_new=30, priority=1)]
    new = seq(2, 22, max_new=5, priority=newcomer_priority)
    return sched, {0: lows, 3: [new]}


@pytest.mark.parametrize("host", [None, 64], ids=["recompute", "swap"])
def test_a_higher_priority_takes_the_place_of_the_newest_lowest_one_when_slots_are_full(host):
    sched, arrivals = two_low_then(newcomer_priority=0, num_host_blocks=host)
    outputs, steps, done_at = drive(sched, arrivals, host or 0)
    # Step 3: r1 (priority 1, admitted after r0) gives way; r2 comes in at the next step.
    assert [s.request_id for s in steps[3].preempted] == ["r1"] and steps[3].admitted == []
    assert [s.request_id for s in steps[4].admitted] == ["r2"]
    # r1 is back only once r2 is done (no thrashing: one preemption in all), then ends as it would have.
    back = next(
        i
        for i, s in enumerate(steps)
        if any(x.request_id == "r1" for x in s.admitted + s.swapped_in) and i > 3
    )
    assert back > done_at["r2"] and sched.num_preemptions == 1
    assert (len(steps[3].swapped_out) == 1) == (host is not None)
    roomy = make(64, max_num_seqs=8)
    expected, _, _ = drive(roomy, two_low_then(0, max_num_seqs=8)[1])
    assert roomy.num_preemptions == 0 and outputs == expected
    assert sched.blocks.num_free_blocks == 64


@pytest.mark.parametrize("priority", [1, 2], ids=["equal", "lower"])
def test_an_equal_or_lower_priority_never_preempts(priority):
    sched, arrivals = two_low_then(newcomer_priority=priority)
    _, steps, done_at = drive(sched, arrivals)
    assert sched.num_preemptions == 0
    admitted_at = next(i for i, s in enumerate(steps) if any(x.request_id == "r2" for x in s.admitted))
    assert admitted_at > min(done_at["r0"], done_at["r1"])  # it waited for a slot


def test_a_higher_priority_takes_blocks_when_the_pool_is_short():
    # 5 blocks: two 32-token prompts hold 4 and need a fifth and sixth for their next tokens.
    sched = make(5)
    low = [seq(0, 32, max_new=10, priority=1), seq(1, 32, max_new=10, priority=1)]
    high = seq(2, 32, max_new=10, priority=0)
    outputs, steps, done_at = drive(sched, {0: low, 1: [high]})
    assert [s.request_id for s in steps[1].preempted] == ["r1"]
    assert [s.request_id for s in steps[2].admitted] == ["r2"]
    assert done_at["r2"] < min(done_at["r0"], done_at["r1"])
    expected, _, _ = drive(make(64), {0: [seq(0, 32, 10), seq(1, 32, 10)], 1: [seq(2, 32, 10)]})
    assert outputs == expected


def test_when_blocks_run_out_the_lowest_priority_gives_way_not_the_newest():
    sched = make(4)
    older_low, newer_high = seq(0, 31, max_new=10, priority=1), seq(1, 31, max_new=10, priority=0)
    _, steps, _ = drive(sched, {0: [older_low], 1: [newer_high]})
    assert steps[1].preempted == [] and [s.request_id for s in steps[1].admitted] == ["r1"]
    # Step 2: r0 needs a third block and none is free. Without priorities r1, the newest, would go.
    assert [s.request_id for s in steps[2].preempted] == ["r0"]


@dataclass
class Seq(SloSeq):
    admitted_before: bool = True  # test_slo's waiting fake, as a running sequence (admitted before)


def test_the_victim_is_the_last_of_strictly_lower_priority_that_the_newcomer_would_go_before():
    step_s, tokens = 0.1, 64
    high = Seq("high", priority=0, admitted_before=False)
    running = [Seq("p0"), Seq("p1-old", priority=1), Seq("p1-new", priority=1)]  # insert's order
    assert victim(running, high, 0.0, step_s, tokens).name == "p1-new"
    assert victim(running[:1], high, 0.0, step_s, tokens) is None  # equal priority: never
    # One still prefilling, its first token due within a step: kept before a newcomer that has time...
    urgent = Seq("p1-urgent", priority=1, ttft_deadline=0.15, num_output_tokens=0)
    assert victim([*running, urgent], high, 0.0, step_s, tokens).name == "p1-new"
    # ...but not before an urgent one of higher priority.
    high_urgent = Seq("high-urgent", priority=0, ttft_deadline=0.1, admitted_before=False)
    assert victim([*running, urgent], high_urgent, 0.0, step_s, tokens).name == "p1-urgent"
    # A deadline is for the first token: once out, it protects nothing.
    past = Seq("p1-decoding", priority=1, ttft_deadline=0.0, num_output_tokens=3)
    assert victim([*running, past], high, 0.0, step_s, tokens).name == "p1-decoding"


def test_the_credit_counts_the_places_a_queued_higher_priority_would_take():
    sched = make(64, max_num_seqs=2)
    sched.add(seq(0, 8, priority=1))
    sched.add(seq(1, 8, priority=0))
    sched.schedule()  # both run: no free slot
    assert sched.admission_window(4) == 0
    assert sched.admission_window(4, best_priority=1) == 0  # outranks neither
    assert sched.admission_window(4, best_priority=0) == 1  # would take r0's place
    assert sched.admission_window(4, best_priority=-3) == 2
    assert sched.admission_window(1, best_priority=-3) == 1  # no more than the depth
