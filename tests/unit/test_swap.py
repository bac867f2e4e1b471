"""Swap preemption in the scheduler, as plain Python: no torch, no gRPC.

A fake worker keeps a token id in every KV slot, makes the step's block copies (swap out, then swap in)
before writing the step's tokens, and reads each sequence's context back through its block table: a
wrong copy, a copy made too late, or a block reused too early shows up as a wrong token."""

from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_ABORTED
from scheduler.batch import StepBuilder
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import SequenceStatus
from scheduler.swap import HostBlockPool
from tests.unit.fakes import kv_slot, one_each, step_arrays
from tests.unit.test_scheduler import BS, EOS, fake_model, seq


def make(num_blocks, num_host_blocks=None, caching=False, **policy):
    policy.setdefault("max_model_len", 256)
    host = None if num_host_blocks is None else HostBlockPool(num_host_blocks)
    blocks = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(SchedulingPolicy(**policy), blocks, eos_token_ids=[EOS], host_blocks=host)


class FakeWorker:
    """Device and host KV as one token id per slot; runs a StepRequest like a shard worker would."""

    def __init__(self, num_blocks, num_host_blocks):
        self.device = [None] * (num_blocks * BS)
        self.host = [None] * (num_host_blocks * BS)
        self.tables: dict[int, list[int]] = {}  # kept across steps, changed by the plan's deltas

    @staticmethod
    def _copy(src, src_blocks, dst, dst_blocks):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            dst[d * BS : (d + 1) * BS] = src[s * BS : (s + 1) * BS]

    def step(self, req, seqs_by_id) -> list[list[int]]:
        a = step_arrays(req)
        self._copy(self.device, req.swap_out_src, self.host, req.swap_out_dst)
        self._copy(self.host, req.swap_in_src, self.device, req.swap_in_dst)
        for seq_id in req.forgotten_seq_ids:
            self.tables.pop(seq_id, None)
        sampled, table_at, token_at = [], 0, 0
        for seq_id, q, ctx, reset, n, samples in zip(
            a["seq_ids"],
            a["query_lens"],
            a["context_lens"],
            a["table_reset"],
            a["new_block_counts"],
            a["sample_counts"],
            strict=True,
        ):
            table = [] if reset else self.tables[seq_id]
            table += a["new_block_ids"][table_at : table_at + n]
            self.tables[seq_id] = table
            table_at += n
            # Slots from the table this worker keeps, as a real worker derives them.
            for p, token in zip(range(ctx - q, ctx), a["input_ids"][token_at : token_at + q], strict=True):
                self.device[kv_slot(table, p, BS)] = token
            token_at += q
            kv = [self.device[kv_slot(table, p, BS)] for p in range(ctx)]
            seq = seqs_by_id[seq_id]
            assert kv == seq.token_ids[:ctx], f"seq {seq_id}: the KV read back is not its tokens"
            if samples:
                sampled.append([fake_model(seq)])
        return sampled


def run(sched, num_host_blocks=0, lose_at=None):
    """Drives the scheduler with a FakeWorker; returns (outputs, steps)."""
    worker = FakeWorker(sched.blocks.num_blocks, num_host_blocks)
    builder = StepBuilder()
    seqs_by_id = {s.seq_id: s for s in sched.waiting}
    outputs: dict[str, list[int]] = {}
    steps = []
    while sched.has_unfinished:
        if len(steps) == lose_at:
            sched.requeue_all()
            host = HostBlockPool(num_host_blocks)
            sched.replace_blocks(BlockManager(sched.blocks.num_blocks, BS), host)
            worker, builder = FakeWorker(sched.blocks.num_blocks, num_host_blocks), StepBuilder()
        out = sched.schedule()
        assert not (out.swap_out and out.swap_in)
        steps.append(out)
        for u in sched.update(out, worker.step(builder.build(out), seqs_by_id)):
            outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
        sched.check_invariants()
        assert len(steps) < 10_000
    return outputs, steps


def add_workload(sched, n=6):
    for i in range(n):
        sched.add(seq(i, 20 + 7 * i, max_new=40))


def test_swap_out_when_blocks_run_out_then_swap_in_where_it_was():
    sched = make(num_blocks=4, num_host_blocks=8)
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, one_each([fake_model(a), fake_model(b)]))
    b_blocks = list(b.block_table)
    # a has 33 tokens and needs a third block: b, the newer, is swapped out, keeping its progress.
    out = sched.schedule()
    assert out.preempted == [b] and out.swapped_out == [b] and out.admitted == []
    assert b.status is SequenceStatus.SWAPPED and b.block_table == [] and b.num_computed_tokens == 31
    assert [d for d, _ in out.swap_out] == b_blocks and sched.swapped == [b]
    assert sched.host_blocks.num_free_blocks == 6
    assert [s.seq for s in out.scheduled] == [a]
    sched.update(out, one_each([fake_model(a)]))
    # Blocks free up when a is aborted: b comes back into fresh blocks and decodes one token.
    sched.abort("r0")
    out = sched.schedule()
    assert out.swapped_in == [b] and sched.swapped == [] and b.status is SequenceStatus.RUNNING
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 1)]
    host = [h for _, h in out.swap_in]
    assert [d for _, d in out.swap_in] == b.block_table[:2] and len(host) == 2
    assert sched.host_blocks.num_free_blocks == 8


def test_recompute_when_host_space_is_short():
    sched = make(num_blocks=4, num_host_blocks=1)  # b's two blocks do not fit
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), one_each([fake_model(a), fake_model(b)]))
    out = sched.schedule()
    assert out.preempted == [b] and out.swapped_out == [] and out.swap_out == []
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and sched.waiting[0] is b


def test_abort_of_a_swapped_sequence_frees_its_host_blocks():
    sched = make(num_blocks=4, num_host_blocks=8)
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), one_each([fake_model(a), fake_model(b)]))
    sched.schedule()
    assert b.status is SequenceStatus.SWAPPED
    assert sched.abort("r1").finish_reason == FINISH_REASON_ABORTED
    assert sched.host_blocks.num_free_blocks == 8 and sched.swapped == []
    sched.abort("r0")
    assert not sched.has_unfinished and sched.blocks.num_free_blocks == 4
    sched.add(seq(2, 3))  # the next step that goes out tells the workers
    assert sorted(sched.schedule().forgotten_seq_ids) == [0, 1]


def test_outputs_equal_with_swap_recompute_a_mix_and_no_preemption():
    def go(num_blocks, num_host_blocks=None, caching=False):
        sched = make(num_blocks, num_host_blocks, caching)
        add_workload(sched)
        outputs, steps = run(sched, num_host_blocks or 0)
        assert sched.blocks.num_free_blocks == num_blocks
        if num_host_blocks is not None:
            assert sched.host_blocks.num_free_blocks == num_host_blocks
        swaps = sum(len(s.swapped_out) for s in steps)
        return outputs, sched.num_preemptions, swaps, sum(len(s.swapped_in) for s in steps)

    roomy, preempted, _, _ = go(200)
    assert preempted == 0
    recompute, preempted, swaps, _ = go(12)
    assert preempted > 0 and swaps == 0 and recompute == roomy
    swap, preempted, swaps, swap_ins = go(12, num_host_blocks=64)
    assert swaps == preempted > 0 and swap_ins == swaps and swap == roomy
    mixed, preempted, swaps, _ = go(12, num_host_blocks=4)
    assert 0 < swaps < preempted and mixed == roomy
    cached, preempted, swaps, _ = go(12, num_host_blocks=64, caching=True)
    assert swaps > 0 and cached == roomy
    assert all(len(v) == 40 for v in swap.values())


def test_swapped_sequences_come_back_before_new_ones_are_admitted():
    sched = make(num_blocks=12, num_host_blocks=64)
    add_workload(sched, n=8)
    admitted_while_swapped = []
    worker, builder = FakeWorker(12, 64), StepBuilder()
    seqs_by_id = {s.seq_id: s for s in sched.waiting}
    while sched.has_unfinished:
        swapped_before = list(sched.swapped)
        out = sched.schedule()
        if sched.swapped and out.admitted:
            admitted_while_swapped.append(out)
        if out.swapped_in:  # oldest first
            assert out.swapped_in == sorted(out.swapped_in, key=lambda s: s.seq_id)
            assert out.swapped_in[0] is swapped_before[0]
        sched.update(out, worker.step(builder.build(out), seqs_by_id))
    assert admitted_while_swapped == [] and sched.num_preemptions > 0


def test_losing_the_workers_drops_host_copies_and_recomputes():
    def go(lose_at):
        sched = make(num_blocks=12, num_host_blocks=64)
        add_workload(sched)
        outputs, steps = run(sched, 64, lose_at)
        assert sched.blocks.num_free_blocks == 12 and sched.host_blocks.num_free_blocks == 64
        return outputs, steps

    roomy, _ = go(lose_at=None)
    _, steps = go(lose_at=None)
    # Lose the workers while some sequence is swapped out.
    lose_at = next(i for i, s in enumerate(steps) if s.swapped_out) + 1
    outputs, _ = go(lose_at)
    assert outputs == roomy


def test_requeue_all_puts_swapped_sequences_back_in_the_queue():
    sched = make(num_blocks=4, num_host_blocks=8)
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), one_each([fake_model(a), fake_model(b)]))
    sched.schedule()
    sched.requeue_all()
    assert list(sched.waiting) == [a, b] and sched.swapped == [] and sched.running == []
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert sched.host_blocks.num_free_blocks == 8 and sched.blocks.num_free_blocks == 4


def test_step_request_carries_the_block_copies():
    sched = make(num_blocks=4, num_host_blocks=8)
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    builder = StepBuilder()
    out = sched.schedule()
    builder.build(out)
    sched.update(out, one_each([fake_model(a), fake_model(b)]))
    b_blocks = list(b.block_table)
    plan = builder.build(sched.schedule())
    assert plan.swap_out_src == b_blocks and plan.swap_out_dst == [0, 1]
    assert plan.swap_in_src == plan.swap_in_dst == []
