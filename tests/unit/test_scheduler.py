"""Block manager and scheduler, as plain Python: no torch, no gRPC."""

import pytest

from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_ABORTED, FINISH_REASON_EOS, FINISH_REASON_LENGTH
from scheduler.batch import StepBuilder
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence, SequenceStatus
from tests.unit.fakes import one_each, step_arrays

BS = 16
EOS = 2


def make(policy=None, num_blocks=64):
    policy = policy or SchedulingPolicy(max_model_len=1024)
    return Scheduler(policy, BlockManager(num_blocks, BS), eos_token_ids=[EOS])


def seq(i, prompt_len, max_new=4, **kw):
    # Prompt tokens avoid EOS so only the fake model decides when EOS appears.
    return Sequence(i, f"r{i}", [10 + (i + j) % 50 for j in range(prompt_len)], prompt_len, max_new, **kw)


def fake_model(s: Sequence) -> int:
    """A deterministic 'model': the next token depends only on the tokens so far, never on batching."""
    return 10 + (sum(s.token_ids) * 31 + len(s.token_ids)) % 90


def run_to_completion(sched, max_steps=10_000):
    """Drives schedule/update like the engine loop; returns (per-request outputs, steps)."""
    steps = []
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return outputs, steps
        out = sched.schedule()
        steps.append(out)
        # The model sees tokens only up to what the step computes; sampling uses the full sequence.
        tokens = [fake_model(s.seq) for s in out.scheduled if s.num_samples]
        for u in sched.update(out, one_each(tokens)):
            outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
        sched.check_invariants()
    raise AssertionError("did not finish")


def test_fcfs_order_of_admission():
    sched = make(SchedulingPolicy(max_num_seqs=2, max_model_len=1024))
    for i in range(4):
        sched.add(seq(i, 5))
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [s.request_id for s in out.admitted] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]


def test_max_num_seqs_caps_the_batch():
    sched = make(SchedulingPolicy(max_num_seqs=3, max_model_len=1024))
    for i in range(10):
        sched.add(seq(i, 5, max_new=8))
    sizes = [len(out.scheduled) for out in run_to_completion(sched)[1]]
    assert max(sizes) == 3


def test_token_budget_splits_long_prompts_across_iterations():
    sched = make(SchedulingPolicy(max_num_batched_tokens=100, max_model_len=1024))
    for i in range(3):
        sched.add(seq(i, 130, max_new=2))
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.num_samples) for s in out.scheduled] == [("r0", 100, 0)]
    sched.update(out, one_each([]))
    out = sched.schedule()
    # r0 finishes its prompt (30) and samples; r1 gets the rest of the budget.
    assert [(s.seq.request_id, s.num_new_tokens, s.num_samples) for s in out.scheduled] == [
        ("r0", 30, 1),
        ("r1", 70, 0),
    ]
    assert out.num_batched_tokens == 100
    sched.update(out, one_each([fake_model(out.scheduled[0].seq)]))
    outputs, steps = run_to_completion(sched)
    assert all(s.num_batched_tokens <= 100 for s in steps)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_chunked_outputs_equal_unchunked():
    def go(budget):
        sched = make(SchedulingPolicy(max_num_batched_tokens=budget, max_model_len=1024))
        for i in range(3):
            sched.add(seq(i, 70 + 40 * i, max_new=6))
        return run_to_completion(sched)[0]

    assert go(32) == go(4096)


def test_preemption_when_blocks_run_out_then_completion_with_same_output():
    def go(num_blocks):
        sched = make(SchedulingPolicy(max_model_len=256), num_blocks=num_blocks)
        for i in range(6):
            sched.add(seq(i, 20 + 7 * i, max_new=40))
        outputs, steps = run_to_completion(sched)
        return outputs, sched

    roomy, roomy_sched = go(200)
    tight, tight_sched = go(12)
    assert roomy_sched.num_preemptions == 0
    assert tight_sched.num_preemptions > 0
    assert tight == roomy
    assert all(len(v) == 40 for v in tight.values())
    assert tight_sched.blocks.num_free_blocks == 12


def test_preemption_takes_the_newest_running_sequence():
    sched = make(SchedulingPolicy(max_model_len=256), num_blocks=4)
    a, b = seq(0, 32, max_new=40), seq(1, 31, max_new=40)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.scheduled) == 2  # 2 blocks each
    sched.update(out, one_each([fake_model(a), fake_model(b)]))
    # a now has 33 tokens and needs a third block: b, the newer, is preempted.
    out = sched.schedule()
    assert out.preempted == [b] and out.admitted == []
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert [s.seq for s in out.scheduled] == [a]
    assert sched.waiting[0] is b


def test_abort_frees_every_block():
    sched = make(num_blocks=32)
    for i in range(5):
        sched.add(seq(i, 40, max_new=50))
    out = sched.schedule()
    sched.update(out, one_each([fake_model(s.seq) for s in out.scheduled if s.num_samples]))
    assert sched.blocks.num_free_blocks < 32
    for i in range(5):
        assert sched.abort(f"r{i}").finish_reason == FINISH_REASON_ABORTED
    assert sched.blocks.num_free_blocks == 32
    assert not sched.has_unfinished
    assert sched.abort("r0") is None
    # The workers hear of them with the next step that goes out: an empty one keeps them.
    assert sched.schedule().forgotten_seq_ids == []
    sched.add(seq(5, 3))
    assert sorted(sched.schedule().forgotten_seq_ids) == [0, 1, 2, 3, 4]


def test_abort_during_a_step_drops_its_token():
    sched = make()
    s = seq(0, 5, max_new=10)
    sched.add(s)
    out = sched.schedule()
    sched.abort("r0")
    assert sched.update(out, one_each([99])) == []
    assert s.num_output_tokens == 0


@pytest.mark.parametrize(
    "kwargs,token,reason",
    [
        ({}, EOS, FINISH_REASON_EOS),
        ({"stop_token_ids": frozenset({77})}, 77, FINISH_REASON_EOS),
        ({"max_new": 1}, 50, FINISH_REASON_LENGTH),
    ],
)
def test_stop_conditions(kwargs, token, reason):
    sched = make()
    max_new = kwargs.pop("max_new", 10)
    s = seq(0, 5, max_new=max_new, **kwargs)
    sched.add(s)
    out = sched.schedule()
    [u] = sched.update(out, one_each([token]))
    assert u.finished and s.finish_reason == reason and s.token_ids[-1] == token
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_ignore_eos_keeps_going_and_max_model_len_stops():
    sched = make(SchedulingPolicy(max_model_len=8))
    s = seq(0, 5, max_new=3, ignore_eos=True)
    sched.add(s)
    for _ in range(2):
        [u] = sched.update(sched.schedule(), one_each([EOS]))
        assert not u.finished
    [u] = sched.update(sched.schedule(), one_each([EOS]))
    assert u.finished and s.finish_reason == FINISH_REASON_LENGTH and s.num_tokens == 8


def test_request_too_long_for_max_model_len_is_refused():
    sched = make(SchedulingPolicy(max_model_len=16))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq(0, 10, max_new=7))
    sched.add(seq(1, 10, max_new=6))
    with pytest.raises(KeyError):
        sched.add(seq(1, 10, max_new=6))


def test_every_block_free_after_all_finish():
    sched = make(
        SchedulingPolicy(max_num_batched_tokens=64, max_num_seqs=5, max_model_len=512), num_blocks=40
    )
    for i in range(25):
        sched.add(seq(i, 1 + (i * 37) % 200, max_new=1 + (i * 13) % 30))
    outputs, _ = run_to_completion(sched)
    assert len(outputs) == 25
    assert sched.blocks.num_free_blocks == 40


def test_static_mode_admits_no_one_until_the_batch_finishes():
    policy = SchedulingPolicy(
        batching="static", static_batch_size=3, max_model_len=1024, static_batch_timeout_ms=1000
    )
    sched = make(policy)
    sched.add(Sequence(0, "r0", [10] * 4, 4, 2, arrival_time=0.0))
    # Not full and not waited long enough: nothing runs yet, and the engine knows when to look again.
    out = sched.schedule(now=0.5)
    assert out.is_empty and out.wake_at == 1.0
    for i in (1, 2, 3):
        sched.add(Sequence(i, f"r{i}", [10] * 4, 4, 2 + 5 * i, arrival_time=0.6))
    out = sched.schedule(now=0.6)
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1", "r2"]
    first = list(sched.running)
    batch_ids = set()
    while not all(s.is_finished for s in first):
        batch_ids |= {s.seq.request_id for s in out.scheduled}
        sched.update(out, one_each([50] * sum(s.num_samples for s in out.scheduled)))
        out = sched.schedule(now=10.0)
    # r3 ran only once r0..r2 had all finished, although r0 finished long before r2.
    assert batch_ids == {"r0", "r1", "r2"}
    assert [s.seq.request_id for s in out.scheduled] == ["r3"]


def test_step_builder_flat_arrays_and_table_deltas():
    sched = make(SchedulingPolicy(max_num_batched_tokens=20, max_model_len=1024))
    a, b = seq(0, 18, max_new=30), seq(1, 5)
    sched.add(a)
    sched.add(b)
    builder = StepBuilder()
    out = sched.schedule()
    req = builder.build(out)
    arr = step_arrays(req)
    assert arr["seq_ids"] == [0, 1] and arr["query_lens"] == [18, 2]
    assert arr["context_lens"] == [18, 2]
    assert arr["sample_counts"] == [1, 0]
    assert [s.seq_id for s in req.new_sequences] == [0, 1]
    assert arr["input_ids"] == a.token_ids + b.token_ids[:2]
    # First sight: whole tables, flagged as resets.
    assert arr["table_reset"] == [1, 1] and arr["new_block_counts"] == [2, 1]
    assert arr["new_block_ids"] == a.block_table + b.block_table
    sched.update(out, one_each([7]))
    arr = step_arrays(req := builder.build(sched.schedule()))
    assert list(req.new_sequences) == []  # sampling state goes to the workers once
    assert arr["query_lens"] == [1, 3] and arr["context_lens"] == [19, 5]
    # Neither gained a block: the workers keep their tables and the step carries no block id.
    assert arr["table_reset"] == [0, 0] and arr["new_block_counts"] == [0, 0]
    assert arr["new_block_ids"] == []
    for _ in range(20):  # a's decodes cross into its third block: only that block travels
        out = sched.schedule()
        arr = step_arrays(builder.build(out))
        sched.update(out, one_each([7] * len(out.sampled)))
        if len(a.block_table) == 3:
            break
    assert arr["new_block_ids"] == [a.block_table[2]] and arr["table_reset"][0] == 0


def test_requeue_all_after_losing_the_workers_recomputes_with_same_output():
    def go(lose_at):
        sched = make(SchedulingPolicy(max_model_len=256), num_blocks=64)
        for i in range(5):
            sched.add(seq(i, 10 + 9 * i, max_new=12))
        outputs: dict[str, list[int]] = {}
        step = 0
        while sched.has_unfinished:
            if step == lose_at:
                sched.requeue_all()
                assert sched.blocks.num_free_blocks == 64 and not sched.running
                sched.replace_blocks(BlockManager(40, BS))
            out = sched.schedule()
            tokens = [fake_model(s.seq) for s in out.scheduled if s.num_samples]
            for u in sched.update(out, one_each(tokens)):
                outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
            step += 1
        assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
        return outputs

    assert go(lose_at=4) == go(lose_at=-1)


def test_prefix_caching_reuses_blocks_and_keeps_outputs():
    system = [10 + j % 40 for j in range(50)]  # a shared 50-token prefix: 3 full blocks

    def go(caching: bool):
        sched = Scheduler(
            SchedulingPolicy(max_model_len=512, max_num_seqs=2),
            BlockManager(40, BS, enable_prefix_caching=caching),
            eos_token_ids=[EOS],
        )
        seqs = [Sequence(i, f"r{i}", system + [60 + i] * (3 + i), 53 + i, 10) for i in range(6)]
        for s in seqs:
            sched.add(s)
        outputs, _ = run_to_completion(sched)
        assert sched.blocks.num_free_blocks == 40
        return outputs, [s.num_cached_tokens for s in seqs]

    plain, no_hits = go(False)
    cached, hits = go(True)
    assert cached == plain
    assert no_hits == [0] * 6
    # The first two are admitted together, before anything is cached; later ones reuse 3 blocks.
    assert hits[:2] == [0, 0] and hits[2:] == [48] * 4


def test_admission_window_fills_free_slots_up_to_the_depth():
    sched = make(SchedulingPolicy(max_num_seqs=4, max_model_len=1024))
    assert sched.admission_window(depth=2) == 2 and sched.admission_window(depth=10) == 4
    for i in range(3):
        sched.add(seq(i, 5, max_new=50))
    assert sched.admission_window(depth=10) == 1  # 4 slots, 3 already waiting
    sched.update(sched.schedule(), one_each([50, 50, 50]))
    assert sched.admission_window(depth=10) == 1  # 3 running, 1 slot free
    static = make(SchedulingPolicy(batching="static", static_batch_size=3, max_model_len=1024))
    assert static.admission_window(depth=32) == 3
    for i in range(3):
        static.add(seq(i, 5, max_new=50))
    static.schedule(now=0.0)
    assert static.admission_window(depth=32) == 0  # a static batch runs: the next one waits its turn


def test_min_batch_wait_is_bounded_and_never_with_nothing_on_the_way():
    policy = SchedulingPolicy(max_model_len=1024, min_batch_size=4, batch_wait_timeout_ms=500)
    sched = make(policy)
    sched.add(seq(0, 5))
    assert sched.batch_wait_deadline(now=10.0, queued=0) is None  # nothing on the way: step now
    assert sched.batch_wait_deadline(now=10.0, queued=3) == 10.5
    assert sched.batch_wait_deadline(now=10.4, queued=3) == 10.5  # the same wait, not a new one
    assert sched.batch_wait_deadline(now=10.5, queued=3) is None  # never longer than the timeout
    assert sched.batch_wait_deadline(now=10.6, queued=3) is None  # and not again for this batch
    for i in (1, 2, 3):
        sched.add(seq(i, 5))
    assert sched.batch_wait_deadline(now=11.0, queued=3) is None  # min_batch_size reached
    off = make(SchedulingPolicy(max_model_len=1024, min_batch_size=4))
    off.add(seq(0, 5))
    assert off.batch_wait_deadline(now=0.0, queued=9) is None  # timeout 0: the wait is off


def test_switching_to_static_freezes_the_running_batch():
    sched = make(SchedulingPolicy(max_model_len=1024, max_num_seqs=8, static_batch_size=2))
    for i in range(3):
        sched.add(seq(i, 5, max_new=3 + 10 * i))
    out = sched.schedule()
    sched.update(out, one_each([50] * 3))
    sched.set_batching("static")
    sched.add(seq(3, 5, max_new=2))
    while not all(sched._by_request.get(f"r{i}") is None for i in range(3)):
        out = sched.schedule(now=100.0)
        assert "r3" not in {s.seq.request_id for s in out.scheduled}
        sched.update(out, one_each([50] * sum(s.num_samples for s in out.scheduled)))
    assert [s.seq.request_id for s in sched.schedule(now=100.0).scheduled] == ["r3"]
    sched.set_batching("continuous")
    assert sched.batching == "continuous"
    with pytest.raises(ValueError):
        sched.set_batching("dynamic")


def test_ranks_back_with_a_smaller_pool_fail_what_no_longer_fits_and_keep_the_rest():
    sched = make(SchedulingPolicy(max_model_len=1024), num_blocks=64)
    short, long = seq(0, 10, max_new=20), seq(1, 300, max_new=200)
    sched.add(short)
    sched.add(long)
    run_steps(sched, 3)
    sched.requeue_all()  # the ranks were lost
    dropped = sched.replace_blocks(BlockManager(20, BS), max_model_len=20 * BS)
    assert [s.request_id for s in dropped] == ["r1"] and long.is_finished
    assert sched.policy.max_model_len == 320 and not sched.has_request("r1")
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq(2, 300, max_new=100))  # new requests meet the new limit too
    outputs, _ = run_to_completion(sched)
    assert short.num_output_tokens == 20 and len(outputs["r0"]) == 17  # 3 before the loss, 17 after


def run_steps(sched, n):
    for _ in range(n):
        out = sched.schedule()
        sched.update(out, one_each([fake_model(s.seq) for s in out.scheduled if s.num_samples]))


def test_min_batch_wait_never_delays_running_sequences_nor_waits_for_what_cannot_join():
    policy = SchedulingPolicy(max_model_len=1024, min_batch_size=8, batch_wait_timeout_ms=500, max_num_seqs=4)
    sched = make(policy)
    sched.add(seq(0, 5, max_new=10))
    # The batch target is at most max_num_seqs (4): waiting for 8 would only stall.
    assert sched.batch_wait_deadline(now=1.0, queued=5) == 1.5
    for i in (1, 2, 3):
        sched.add(seq(i, 5, max_new=10))
    assert sched.batch_wait_deadline(now=1.1, queued=5) is None  # 4 waiting: as full as it can get
    # An admission depth of 2 below min_batch_size: 2 waiting is a full first batch.
    shallow = make(SchedulingPolicy(max_model_len=1024, min_batch_size=8, batch_wait_timeout_ms=500))
    shallow.add(seq(0, 5))
    shallow.add(seq(1, 5))
    assert shallow.batch_wait_deadline(now=0.0, queued=9, admission_depth=2) is None
    assert shallow.batch_wait_deadline(now=0.0, queued=9, admission_depth=3) == 0.5  # room for a third
    # Running sequences are never held back, whatever is on its way.
    out = sched.schedule()
    sched.update(out, one_each([50] * len(out.scheduled)))
    sched.add(seq(9, 5))
    assert sched.running and sched.batch_wait_deadline(now=2.0, queued=5) is None


def test_requeue_all_keeps_first_admission_figures():
    """After the ranks are lost, re-admission is not a new queue wait, and Usage.cached_tokens keeps
    what the request found at its first admission (both were overwritten before)."""
    prefix = [10 + j % 40 for j in range(40)]
    sched = Scheduler(
        SchedulingPolicy(max_model_len=256), BlockManager(64, BS, enable_prefix_caching=True), [EOS]
    )
    first = Sequence(0, "r0", prefix + [60], 41, 10)
    sched.add(first)
    out = sched.schedule()
    assert out.first_admitted == [first]
    sched.update(out, one_each([fake_model(first)]))
    second = Sequence(1, "r1", prefix + [61], 41, 10)
    sched.add(second)
    out = sched.schedule()
    assert out.first_admitted == [second] and second.num_cached_tokens == 32
    sched.update(out, one_each([fake_model(s.seq) for s in out.sampled]))
    sched.requeue_all()
    sched.replace_blocks(BlockManager(64, BS, enable_prefix_caching=True))  # fresh caches: no hits
    out = sched.schedule()
    assert {s.seq_id for s in out.admitted} == {0, 1} and out.first_admitted == []
    assert second.num_cached_tokens == 32
