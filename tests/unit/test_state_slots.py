"""Recurrent-state slots (scheduler/state_slots.py, common/kv_cache_spec.py RecurrentStateSpec) in the
scheduler, as plain Python with a fake worker.

The fake worker keeps, in each state slot, the tokens the sequence holding it has consumed (what a real
linear-attention state summarises), makes the step's state copies (swap out, then in) before the
forward, starts a sequence's state afresh where its step begins at position 0, and checks that the
state it reads is exactly the sequence's tokens so far: a slot handed to two sequences, freed too early,
copied wrongly or not carried across chunked-prefill chunks shows up as a wrong state."""

from __future__ import annotations

import numpy as np
import pytest

from common import kv_cache_spec
from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_ABORTED
from scheduler.batch import StepBuilder
from scheduler.block_manager import BlockManager
from scheduler.capacity import RankCapacity, settle
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import SequenceStatus
from scheduler.state_slots import StateSlots
from scheduler.swap import HostBlockPool
from tests.unit.fakes import one_each, step_arrays
from tests.unit.test_scheduler import BS, EOS, fake_model, seq


def make(num_blocks, num_slots, num_host_blocks=0, num_host_slots=0, caching=False, **policy):
    policy.setdefault("max_model_len", 256)
    host = HostBlockPool(num_host_blocks) if num_host_blocks else None
    state = StateSlots(num_slots, num_host_slots)
    blocks = BlockManager(num_blocks, BS, enable_prefix_caching=caching, state=state)
    return Scheduler(SchedulingPolicy(**policy), blocks, eos_token_ids=[EOS], host_blocks=host)


class FakeStateWorker:
    def __init__(self, num_slots, num_host_slots):
        self.device = [None] * num_slots
        self.host = [None] * num_host_slots

    def step(self, req, seqs_by_id) -> list[list[int]]:
        for src, dst in zip(req.state_swap_out_src, req.state_swap_out_dst, strict=True):
            self.host[dst] = self.device[src]
        for src, dst in zip(req.state_swap_in_src, req.state_swap_in_dst, strict=True):
            self.device[dst] = self.host[src]
        a = step_arrays(req)
        slots = np.frombuffer(req.state_slots, dtype="<i8").tolist()
        assert len(slots) == len(a["seq_ids"]), "every scheduled sequence has its slot"
        sampled, at = [], 0
        for seq_id, q, ctx, slot, samples in zip(
            a["seq_ids"], a["query_lens"], a["context_lens"], slots, a["sample_counts"], strict=True
        ):
            state = [] if ctx == q else list(self.device[slot])
            state += a["input_ids"][at : at + q]
            at += q
            seq = seqs_by_id[seq_id]
            assert state == seq.token_ids[:ctx], f"seq {seq_id}: its state is not its tokens"
            self.device[slot] = state
            if samples:
                sampled.append([fake_model(seq)])
        return sampled


def run(sched, num_slots, num_host_slots=0):
    worker, builder = FakeStateWorker(num_slots, num_host_slots), StepBuilder()
    seqs_by_id = {s.seq_id: s for s in sched.waiting}
    outputs: dict[str, list[int]] = {}
    steps = []
    while sched.has_unfinished:
        out = sched.schedule()
        steps.append(out)
        for u in sched.update(out, worker.step(builder.build(out), seqs_by_id)):
            outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
        sched.check_invariants()
        assert len(steps) < 10_000
    return outputs, steps


def workload(sched, n=6):
    for i in range(n):
        sched.add(seq(i, 20 + 7 * i, max_new=40))


def go(num_blocks, num_slots, num_host_blocks=0, num_host_slots=0, tokens=64):
    sched = make(num_blocks, num_slots, num_host_blocks, num_host_slots, max_num_batched_tokens=tokens)
    workload(sched)
    outputs, steps = run(sched, num_slots, num_host_slots)
    state = sched.blocks.state
    assert state.num_free == num_slots, "every slot back once every sequence finished"
    state.check_invariants(holders=[])
    return outputs, sched, steps


def test_states_stay_right_through_chunks_recompute_and_swap():
    roomy, sched, steps = go(200, 8)
    assert sched.num_preemptions == 0
    assert any(s.num_new_tokens < s.seq.num_prompt_tokens for o in steps for s in o.scheduled), "chunked"
    few_slots, sched, _ = go(200, 2)  # slots, not blocks, bound the batch
    assert few_slots == roomy
    recompute, sched, _ = go(12, 8)
    assert sched.num_preemptions > 0 and recompute == roomy
    swap, sched, steps = go(12, 8, num_host_blocks=64, num_host_slots=8)
    assert sum(len(s.state_swap_out) for s in steps) == sum(len(s.swapped_out) for s in steps) > 0
    assert sum(len(s.state_swap_in) for s in steps) == sum(len(s.swapped_in) for s in steps)
    assert swap == roomy
    # Host blocks to spare but one host slot: swaps while it is free, recomputes otherwise.
    mixed, sched, steps = go(12, 8, num_host_blocks=64, num_host_slots=1)
    swaps = sum(len(s.swapped_out) for s in steps)
    assert 0 < swaps < sched.num_preemptions and mixed == roomy


def test_admission_waits_for_a_free_slot():
    sched = make(num_blocks=64, num_slots=2)
    for i in range(3):
        sched.add(seq(i, 5, max_new=3))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1] and sched.blocks.state.num_free == 0
    assert sorted(s.state_slot for s in sched.running) == [0, 1]


def test_a_slot_is_freed_once_on_finish_abort_and_preemption():
    sched = make(num_blocks=4, num_slots=3)
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert (a.state_slot, b.state_slot) == (0, 1)
    sched.update(out, one_each([fake_model(a), fake_model(b)]))
    # a needs a third block: b is preempted (no swap space: recomputed), its slot goes back.
    out = sched.schedule()
    assert out.preempted == [b] and b.state_slot is None and sched.blocks.state.num_free == 2
    sched.blocks.free(b)  # freeing again finds nothing to give back
    assert sched.blocks.state.num_free == 2
    sched.check_invariants()
    sched.update(out, one_each([fake_model(a)]))
    assert sched.abort("r0").finish_reason == FINISH_REASON_ABORTED
    assert sched.blocks.state.num_free == 3
    sched.check_invariants()
    out = sched.schedule()  # b comes back with a slot, from position 0
    assert out.admitted == [b] and b.state_slot is not None and b.num_computed_tokens == 0
    sched.abort("r1")
    assert sched.blocks.state.num_free == 3 and not sched.has_unfinished
    sched.check_invariants()


def test_swap_carries_the_slot():
    sched = make(num_blocks=4, num_slots=3, num_host_blocks=8, num_host_slots=2)
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    builder = StepBuilder()
    out = sched.schedule()
    builder.build(out)
    sched.update(out, one_each([fake_model(a), fake_model(b)]))
    b_slot = b.state_slot
    out = sched.schedule()
    assert out.swapped_out == [b] and b.status is SequenceStatus.SWAPPED
    plan = builder.build(out)
    assert list(plan.state_swap_out_src) == [b_slot] and len(plan.state_swap_out_dst) == 1
    host_slot = plan.state_swap_out_dst[0]
    sched.update(out, one_each([fake_model(a)]))
    sched.abort("r0")
    out = sched.schedule()
    assert out.swapped_in == [b]
    plan = builder.build(out)
    assert list(plan.state_swap_in_src) == [host_slot] and list(plan.state_swap_in_dst) == [b.state_slot]
    assert np.frombuffer(plan.state_slots, dtype="<i8").tolist() == [b.state_slot]
    sched.update(out, one_each([fake_model(b)]))
    assert sched.blocks.state.num_free == 2
    sched.check_invariants()


def test_abort_while_swapped_frees_the_host_slot():
    sched = make(num_blocks=4, num_slots=3, num_host_blocks=8, num_host_slots=1)
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), one_each([fake_model(a), fake_model(b)]))
    sched.schedule()
    assert b.status is SequenceStatus.SWAPPED and not sched.blocks.state.can_swap_out()
    sched.abort("r1")
    sched.schedule()  # the next step: host slots read this step are reusable
    assert sched.blocks.state.can_swap_out() and sched.blocks.state.num_free == 2
    sched.check_invariants()


def test_no_prefix_reuse_with_recurrent_state():
    sched = make(num_blocks=64, num_slots=4, caching=True)
    first = seq(0, 40, max_new=2)
    sched.add(first)
    run(sched, 4)
    again = seq(1, 40, max_new=2)
    again.token_ids[:] = first.token_ids[:40]
    assert sched.blocks.match_prefix(again) == 0 and not sched.blocks.enable_prefix_caching


def test_the_budget_splits_into_slots_and_blocks():
    block, slot = 1000, 5000
    assert kv_cache_spec.split_budget(100_000, block, 0, 8) == (100, 0)
    assert kv_cache_spec.split_budget(100_000, block, slot, 8) == (60, 8)  # 8 slots, the rest in blocks
    assert kv_cache_spec.split_budget(30_000, block, slot, 8) == (5, 5)  # each slot with a block beside
    assert kv_cache_spec.sequences_with_state(60, 4, 8) == 8
    assert kv_cache_spec.sequences_with_state(60, 10, 8) == 6


@pytest.mark.parametrize("swap_gib", [0.0, 1.0])
def test_capacity_settles_the_fewest_slots_and_takes_host_slots_from_swap_space(swap_gib):
    ranks = [RankCapacity(r, 100, 2**20, 4096, 8 * 2**20, n) for r, n in enumerate([6, 5])]
    cap = settle(ranks, block_size=16, max_num_seqs=8, swap_space_gib=swap_gib)
    assert cap.state.num_slots == 5 and cap.state.slot_bytes == 8 * 2**20
    if swap_gib:  # 5 host slots of 8 MiB and a block each fit in 1 GiB; the rest is blocks
        assert cap.state.num_host_slots == 5 and cap.num_host_blocks == 1024 - 40
    else:
        assert cap.state.num_host_slots == 0 and cap.num_host_blocks == 0
    blocks = BlockManager.of(cap, 16, True, None)
    assert blocks.state.num_slots == 5 and not blocks.enable_prefix_caching
