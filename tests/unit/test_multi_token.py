"""Steps that give a sequence several tokens: a proposer's tokens verified in one step, as plain Python.

A fake proposer proposes some sequences' true continuation (the fake model's), others a wrong one, and
a fake worker verifies them the way rank 0's sampler does: it samples each proposed position in turn and
goes on while the token equals the proposal there. So some steps give a sequence 3 tokens, some 1 or 2.
Outputs must equal a run without proposals, token for token; stop conditions inside a step's tokens end
the sequence there; the KV of rejected proposals is rolled back; every block is free at the end."""

from __future__ import annotations

import pytest

from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_EOS, FINISH_REASON_LENGTH
from scheduler.batch import StepBuilder
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence
from tests.unit.fakes import kv_slot, step_arrays
from tests.unit.test_scheduler import BS, EOS, fake_model, seq


def continuation(tokens: list[int], n: int) -> list[int]:
    """The fake model's next n tokens after these."""
    out = []
    for _ in range(n):
        out.append(fake_model(Sequence(0, "x", tokens + out, len(tokens), 1)))
    return out


class AnyBatch:
    """A proposer that proposes whatever the batch size."""

    def enabled(self, batch_size: int) -> bool:
        return True


class FakeProposer(AnyBatch):
    """Proposes k tokens: the true continuation for even seq ids, a wrong second token for seq ids that
    are 1 mod 4, and nothing for the others."""

    def __init__(self, k: int = 2):
        self.k = k
        self.calls = 0

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        self.calls += 1
        n = min(self.k, max_tokens)
        truth = continuation(seq.token_ids, n)
        if seq.seq_id % 2 == 0:
            return truth
        if seq.seq_id % 4 == 1 and n >= 2:
            return [truth[0], (truth[1] + 1) % 90 + 10]
        return []


def verify(item) -> list[int]:
    """What rank 0 answers for a sequence: sample its positions in order while each token equals the
    proposal after it (the fake model is greedy)."""
    tokens, context = [], list(item.seq.token_ids)
    for depth in range(item.num_samples):
        t = continuation(context, 1)[0]
        tokens.append(t)
        if depth + 1 < item.num_samples and t != item.draft_token_ids[depth]:
            break
        context.append(t)
    return tokens


def run(sched: Scheduler, kv: list | None = None) -> dict[str, list[int]]:
    """Drives schedule/verify/update; with kv, a fake cache checks each sequence reads its own tokens'
    KV, including after proposals were rolled back."""
    outputs: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not sched.has_unfinished:
            return outputs
        out = sched.schedule()
        for item in out.scheduled:
            s = item.seq
            start, end = s.num_computed_tokens, s.num_computed_tokens + item.num_new_tokens
            inputs = s.token_ids[start : end - len(item.draft_token_ids)] + item.draft_token_ids
            if kv is not None:
                context = s.token_ids[:start] + inputs
                for p in range(start, end):
                    kv[kv_slot(s.block_table, p, BS)] = tuple(context[: p + 1])
                for p in range(end):
                    assert kv[kv_slot(s.block_table, p, BS)] == tuple(context[: p + 1])
        for u in sched.update(out, [verify(item) for item in out.sampled]):
            outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
        sched.check_invariants()
    raise AssertionError("did not finish")


def make(proposer=None, num_blocks=200, **policy):
    policy.setdefault("max_model_len", 512)
    return Scheduler(SchedulingPolicy(**policy), BlockManager(num_blocks, BS), [EOS], proposer=proposer)


def workload(sched: Scheduler, ignore_eos: bool = True) -> None:
    for i in range(12):
        sched.add(seq(i, 5 + 13 * i, max_new=30 + i, ignore_eos=ignore_eos))


@pytest.mark.parametrize("budget,num_blocks", [(2048, 200), (40, 200), (2048, 24)])
def test_outputs_equal_a_run_without_proposals(budget, num_blocks):
    """Also with chunked prefill (a small budget) and with preemption (few blocks)."""
    plain = make(max_num_batched_tokens=budget, num_blocks=num_blocks)
    workload(plain)
    expected = run(plain)
    proposer = FakeProposer()
    sched = make(proposer, max_num_batched_tokens=budget, num_blocks=num_blocks)
    workload(sched)
    got = run(sched, kv=[None] * (num_blocks * BS))
    assert got == expected
    assert proposer.calls > 0
    assert sched.blocks.num_free_blocks == num_blocks


def test_a_step_gives_several_tokens_and_rejected_proposals_roll_back():
    sched = make(FakeProposer(k=2))
    a, b = seq(0, 30, max_new=20, ignore_eos=True), seq(1, 31, max_new=20, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, [verify(i) for i in out.sampled])  # the prompts: one token each
    out = sched.schedule()
    by_seq = {i.seq.seq_id: i for i in out.scheduled}
    assert by_seq[0].num_new_tokens == 3 and by_seq[0].num_samples == 3
    assert by_seq[1].draft_token_ids and by_seq[1].num_samples == 3
    # Both compute their next position and two proposals: a third block each.
    assert len(a.block_table) == len(b.block_table) == 3
    [ua, ub] = sched.update(out, [verify(i) for i in out.sampled])
    assert len(ua.new_tokens) == 3 and len(ub.new_tokens) == 2
    # a: its last token's KV is not computed yet; b: the rejected proposal's KV is not counted.
    assert a.num_computed_tokens == a.num_tokens - 1 == 33
    assert b.num_computed_tokens == b.num_tokens - 1 == 33
    # b's next token (position 33) is in its third block, which it keeps.
    assert len(b.block_table) == 3 and b.num_tokens == 34
    sched.check_invariants()


def test_a_rejected_proposal_past_a_block_boundary_returns_the_block():
    """All proposals rejected: the block that held only their slots goes back to the pool, and the next
    step sends the sequence's shrunk table whole (the workers held a longer one)."""

    class Wrong(AnyBatch):
        def propose(self, seq, max_tokens):
            return [(t + 1) % 90 + 10 for t in continuation(seq.token_ids, 2)][:max_tokens]

    sched = make(Wrong())
    builder = StepBuilder()
    s = seq(0, 30, max_new=20, ignore_eos=True)
    sched.add(s)
    out = sched.schedule()
    builder.build(out)
    sched.update(out, [verify(i) for i in out.sampled])  # 31 tokens, 30 computed
    out = sched.schedule()  # position 30, proposals at 31 and 32: a third block
    builder.build(out)
    assert len(s.block_table) == 3
    [u] = sched.update(out, [verify(i) for i in out.sampled])
    assert len(u.new_tokens) == 1 and s.num_tokens == 32 and s.num_computed_tokens == 31
    assert len(s.block_table) == 2 and sched.blocks.num_free_blocks == 198
    sched.check_invariants()
    arr = step_arrays(builder.build(sched.schedule()))
    assert arr["table_reset"] == [1] and arr["new_block_ids"] == s.block_table


def test_eos_inside_a_step_ends_the_sequence_there():
    """A sequence whose accepted run contains EOS stops at it: the tokens after it are dropped and
    every block is free."""
    tokens = [11] * 10
    truth = continuation(tokens, 2)

    class EosProposer(AnyBatch):
        def propose(self, seq, max_tokens):
            return [truth[1], EOS][:max_tokens]

    sched = make(EosProposer(), num_blocks=50)
    s = Sequence(0, "r0", tokens, len(tokens), 20)
    sched.add(s)
    out = sched.schedule()
    sched.update(out, [[truth[0]]])
    out = sched.schedule()
    assert out.sampled[0].num_samples == 3
    # The worker accepted both proposals (the model agreed) and sampled one more after EOS.
    [u] = sched.update(out, [[truth[1], EOS, 77]])
    assert u.new_tokens == [truth[1], EOS] and u.finished and s.finish_reason == FINISH_REASON_EOS
    assert s.token_ids[-2:] == [truth[1], EOS]
    assert sched.blocks.num_free_blocks == 50 and not sched.has_unfinished


def test_max_new_tokens_inside_a_step_ends_the_sequence_there():
    sched = make(FakeProposer(k=3))
    s = seq(0, 10, max_new=3, ignore_eos=True)
    sched.add(s)
    out = sched.schedule()
    sched.update(out, [verify(i) for i in out.sampled])
    out = sched.schedule()
    # Proposals never reach past max_new_tokens: one token left to make, so none are proposed.
    assert out.sampled[0].num_samples == 1 + 1
    [u] = sched.update(out, [verify(i) for i in out.sampled])
    assert u.finished and s.finish_reason == FINISH_REASON_LENGTH and s.num_output_tokens == 3
    assert sched.blocks.num_free_blocks == 200


def test_update_refuses_an_answer_of_the_wrong_size():
    sched = make(FakeProposer(k=2))
    sched.add(seq(0, 10, max_new=10, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, [verify(i) for i in out.sampled])
    out = sched.schedule()
    with pytest.raises(ValueError, match="4 tokens for 3 sampled positions"):
        sched.update(out, [[1, 2, 3, 4]])


def test_proposals_never_preempt_another_sequence():
    """With no block to spare, a sequence runs without its proposals rather than taking blocks."""
    sched = make(FakeProposer(k=2), num_blocks=4)
    a, b = seq(0, 31, max_new=20, ignore_eos=True), seq(2, 31, max_new=20, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, [verify(i) for i in out.sampled])
    out = sched.schedule()  # each needs its second block for position 31; proposals would need more
    assert not out.preempted
    assert [i.draft_token_ids for i in out.scheduled] == [[], []]


def test_an_earlier_sequences_proposals_leave_the_block_a_later_one_needs():
    """The first sequence's proposals would take the last free block, which the second needs for its
    own next token: it proposes nothing rather than get the second preempted."""
    sched = make(FakeProposer(k=4), num_blocks=4)
    a, b = seq(0, 2 * BS - 1, max_new=20, ignore_eos=True), seq(2, BS, max_new=20, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, [verify(i) for i in out.sampled])
    # a: 2 blocks, its next position fits, its proposals need a third; b: 1 block, its next position
    # (BS) needs a second. One block is free.
    assert sched.blocks.num_free_blocks == 1
    out = sched.schedule()
    assert not out.preempted and [i.seq for i in out.scheduled] == [a, b]


def test_accepted_proposals_register_the_blocks_they_complete_with_their_tokens_hashes():
    """With prefix caching, a block completed by accepted proposals is cached under the hash of its
    tokens: a later prompt with the same tokens finds it."""
    policy = SchedulingPolicy(max_model_len=512)
    blocks = BlockManager(200, BS, enable_prefix_caching=True)
    sched = Scheduler(policy, blocks, [EOS], proposer=FakeProposer(k=4))
    s = seq(0, BS + 2, max_new=BS, ignore_eos=True)
    sched.add(s)
    run(sched)
    again = Sequence(1, "r1", s.token_ids[: 2 * BS] + [7], 2 * BS + 1, 1)
    assert sched.blocks.match_prefix(again) == 2 * BS
