"""Cache specs per layer group (full attention, sliding window) in the block manager and the scheduler, as
plain Python.

A fake worker keeps (group, token) in every KV slot of one shared pool, writes each group's new tokens
through that group's table, makes the step's swap copies first, and reads back every key each group's
queries attend to (all of them for full attention, the window for a sliding group): a block released too
early, handed to two groups, swapped wrongly or reused from the prefix cache for other content shows up
as a wrong key."""

import pytest

from common.kv_cache_spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    group_layers,
    num_blocks,
    padding,
    sequences_held,
)
from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_ABORTED
from scheduler.block_manager import HOLE, BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import SequenceStatus
from scheduler.swap import HostBlockPool
from tests.unit.fakes import kv_slot, one_each
from tests.unit.test_scheduler import BS, EOS, fake_model, seq

WINDOW = 40  # tokens: a query reads 40 keys, so 2-4 blocks of 16 stay held


def windows(num_layers: int, full_every: int, window: int = WINDOW) -> list[int | None]:
    """Gemma 3's pattern: every full_every-th layer full attention, the others sliding."""
    return [None if (i + 1) % full_every == 0 else window for i in range(num_layers)]


def test_specs_say_which_blocks_later_queries_read():
    full, sliding = FullAttentionSpec(16), SlidingWindowSpec(16, 40)
    assert full.first_needed_block(1000) == 0 and full.blocks_held(100) == 7
    # The next query at 55 reads keys 16-55: block 0 (keys 0-15) is never read again; one at 54 reads 15.
    assert sliding.first_needed_block(55) == 1
    assert sliding.first_needed_block(54) == 0
    assert sliding.first_needed_block(1000) == (1000 - 40 + 1) // 16
    assert sliding.blocks_held(1000) == 63 - 60
    with pytest.raises(ValueError):
        SlidingWindowSpec(16, 0)


def test_layers_grouped_by_kind_with_full_attention_first():
    gemma = group_layers(windows(18, 6), 16)  # Gemma 3 270M: 15 sliding, 3 full
    assert gemma.layers_per_block == 3 and gemma.num_groups == 6
    assert gemma.groups[0].spec == FullAttentionSpec(16) and gemma.groups[0].layers == (5, 11, 17)
    assert all(g.spec == SlidingWindowSpec(16, WINDOW) for g in gemma.groups[1:])
    assert gemma.tensor_of(11) == 1 and gemma.tensor_of(0) == 0 and padding(gemma) == 0
    oss = group_layers([128 if i % 2 == 0 else None for i in range(24)], 16)  # gpt-oss: alternating
    assert oss.layers_per_block == 12 and oss.num_groups == 2
    llama = group_layers([None] * 30, 16)
    assert llama.num_groups == 1 and llama.layers_per_block == 30
    odd = group_layers(windows(8, 3), 16)  # 6 sliding, 2 full: groups of 2
    assert odd.num_groups == 4 and padding(odd) == 0
    lop = group_layers([None, None, 7, 7, 7], 16)  # 3 sliding in groups of 2: one page a block unused
    assert lop.num_groups == 3 and padding(lop) == 1


def test_capacity_at_one_budget_counts_what_each_group_holds():
    """Gemma 3 270M's cache (1 KV head of 256, bf16: a page of 16 tokens is 16 KiB a layer), 1 GiB, 512-token
    windows: the pool has 6x the blocks of an all-full layout, and at 4k tokens holds 3.7x the sequences."""
    page, budget = 2 * 16 * 1 * 256 * 2, 2**30
    all_full = group_layers([None] * 18, 16)
    hybrid = group_layers(windows(18, 6, window=512), 16)
    full_blocks, hybrid_blocks = num_blocks(budget, all_full, page), num_blocks(budget, hybrid, page)
    assert (full_blocks, hybrid_blocks) == (3640, 21845)
    assert sequences_held(full_blocks, all_full, 4096) == 14
    assert hybrid.blocks_held(4096) == 256 + 5 * (256 - 224)
    assert sequences_held(hybrid_blocks, hybrid, 4096) == 52
    # Short sequences (inside the window) cost the same bytes either way.
    assert sequences_held(hybrid_blocks, hybrid, 512) == sequences_held(full_blocks, all_full, 512)


class GroupedWorker:
    """Device and host KV of one pool as (group, token) per slot; each group addressed by its own table."""

    def __init__(self, blocks: BlockManager, num_host_blocks: int = 0):
        self.blocks = blocks
        self.device = [None] * (blocks.num_blocks * BS)
        self.host = [None] * (num_host_blocks * BS)

    def _copy(self, src, src_blocks, dst, dst_blocks):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            dst[d * BS : (d + 1) * BS] = src[s * BS : (s + 1) * BS]

    def step(self, out) -> list[list[int]]:
        self._copy(self.device, [s for s, _ in out.swap_out], self.host, [d for _, d in out.swap_out])
        self._copy(self.host, [s for s, _ in out.swap_in], self.device, [d for _, d in out.swap_in])
        sampled = []
        for item in out.scheduled:
            s, q = item.seq, item.num_new_tokens
            ctx = s.num_computed_tokens + q
            for g, (spec, table) in enumerate(zip(self.blocks.specs, self.blocks.tables(s), strict=True)):
                for p in range(ctx - q, ctx):
                    self.device[kv_slot(table, p, BS)] = (g, s.token_ids[p])
                # The keys the step's first query reads; later queries read no earlier ones.
                first = 0 if isinstance(spec, FullAttentionSpec) else max(0, ctx - q - spec.window + 1)
                keys = range(first, ctx)
                read = [self.device[kv_slot(table, p, BS)] for p in keys]
                assert read == [(g, s.token_ids[p]) for p in keys], f"seq {s.seq_id} group {g}: wrong keys"
            if item.num_samples:
                sampled.append(fake_model(s))
        return one_each(sampled)


HYBRID = windows(6, 3)  # 2 full layers, 4 sliding: a full group and two sliding groups of 2


def make(num_blocks, caching=False, num_host_blocks=None, layers=HYBRID, **policy):
    policy.setdefault("max_model_len", 512)
    policy.setdefault("max_num_batched_tokens", 64)
    host = None if num_host_blocks is None else HostBlockPool(num_host_blocks)
    layout = group_layers(layers, BS)
    blocks = BlockManager(num_blocks, BS, enable_prefix_caching=caching, layout=layout)
    return Scheduler(SchedulingPolicy(**policy), blocks, eos_token_ids=[EOS], host_blocks=host)


def drive(sched, num_host_blocks=0, on_step=lambda sched, out: None, worker=None):
    worker = worker or GroupedWorker(sched.blocks, num_host_blocks)
    outputs: dict[str, list[int]] = {}
    steps = []
    while sched.has_unfinished:
        out = sched.schedule()
        steps.append(out)
        for u in sched.update(out, worker.step(out)):
            outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
        sched.check_invariants()
        on_step(sched, out)
        assert len(steps) < 10_000
    return outputs, steps


def expected_outputs(n, prompt_len, max_new):
    ref = Scheduler(SchedulingPolicy(max_model_len=512), BlockManager(512, BS), eos_token_ids=[EOS])
    for i in range(n):
        ref.add(seq(i, prompt_len(i), max_new=max_new))
    outputs, _ = drive(ref)
    return outputs


def held(sched, group: int) -> int:
    return sum(sum(b != HOLE for b in sched.blocks.tables(s)[group]) for s in sched.running)


def test_sliding_blocks_are_released_while_a_sequence_runs():
    sched = make(64)
    sched.add(seq(0, 100, max_new=60))
    most = []
    outputs, _ = drive(sched, on_step=lambda sched, out: most.append((held(sched, 0), held(sched, 1))))
    assert outputs == expected_outputs(1, lambda i: 100, 60)
    # The full group grows to the whole sequence; the sliding group never holds more than the window's
    # blocks plus the one being filled (4), even though its 64-token prefill chunks needed more.
    assert max(f for f, _ in most) == 10
    assert max(s for _, s in most[2:]) <= 4
    assert sched.blocks.num_free_blocks == 64


def test_more_sequences_fit_when_sliding_blocks_go_back():
    """12 sequences of 160 tokens in a pool of 90 blocks of every layer: 9 fit at full length (10 blocks);
    at the same bytes, 180 blocks of half the layers hold all 12 (10 full and about 4 sliding blocks
    each). Outputs are those of a roomy pool either way."""

    def most_running(layers, pool):
        sched = make(pool, layers=layers, max_num_seqs=12)
        for i in range(12):
            sched.add(seq(i, 100, max_new=60))
        peak = []
        outputs, _ = drive(sched, on_step=lambda sched, out: peak.append(len(sched.running)))
        assert outputs == expected_outputs(12, lambda i: 100, 60)
        return max(peak), sched.num_preemptions

    all_full = most_running([None] * 6, 90)  # one group of 6 layers: pool blocks of 6 pages
    # 2 groups of 3 layers: each block is half the bytes, so the same bytes are 180 blocks.
    hybrid = most_running(windows(6, 2), 180)
    assert all_full[1] > 0 and hybrid[1] == 0  # preemptions


@pytest.mark.parametrize("host", [None, 200], ids=["recompute", "swap"])
def test_preemption_frees_each_group_once_and_outputs_stay_the_same(host):
    sched = make(30, num_host_blocks=host)
    for i in range(6):
        sched.add(seq(i, 30 + 11 * i, max_new=50))
    outputs, steps = drive(sched, num_host_blocks=host or 0)
    assert sched.num_preemptions > 0
    assert bool(host) == any(out.swapped_out for out in steps)
    assert outputs == expected_outputs(6, lambda i: 30 + 11 * i, 50)
    assert sched.blocks.num_free_blocks == 30
    assert not sched.blocks._tables  # no group's table left behind


def test_swap_copies_only_the_blocks_each_group_still_reads():
    sched = make(64, num_host_blocks=64)
    s = seq(0, 120, max_new=10)
    sched.add(s)
    worker = GroupedWorker(sched.blocks, 64)
    while s.num_computed_tokens < 120:
        out = sched.schedule()
        sched.update(out, worker.step(out))
    computed = sched.blocks.computed_blocks(s)
    # 8 full blocks, and each sliding group's (2 of them) from (121 - 40 + 1) // 16 = 5 on: 3.
    assert len(computed) == 8 + 2 * 3
    out = sched.schedule()  # decodes token 121
    sched.update(out, worker.step(out))
    sched._preempt(s, out)
    worker._copy(worker.device, [d for d, _ in out.swap_out], worker.host, [h for _, h in out.swap_out])
    assert s.status is SequenceStatus.SWAPPED and len(out.swap_out) == 8 + 2 * 3
    assert sched.blocks.num_free_blocks == 64
    drive(sched, worker=worker)  # the worker's host copy comes back through swap-ins, keys checked
    assert s.token_ids[120:] == alone(s.token_ids[:120], 10)
    sched.check_invariants()


def test_abort_frees_every_group():
    sched = make(64)
    sched.add(seq(0, 100, max_new=200))
    worker = GroupedWorker(sched.blocks)
    for _ in range(4):
        out = sched.schedule()
        sched.update(out, worker.step(out))
    assert held(sched, 1) < held(sched, 0)
    sched.abort("r0")
    assert sched.get("r0") is None or sched.get("r0").finish_reason == FINISH_REASON_ABORTED
    assert sched.blocks.num_free_blocks == 64
    sched.check_invariants()


def test_prefix_cache_reuses_a_group_only_for_its_own_prefix():
    sched = make(64, caching=True)
    first = seq(0, 100, max_new=5)
    sched.add(first)
    worker = GroupedWorker(sched.blocks)
    drive(sched, worker=worker)
    # Same first 100 tokens: group 0's 6 full blocks are cached, and the sliding group's blocks inside
    # the window before token 96 (blocks 3-5); blocks 0-2 it released were cached too, but are not needed.
    again = seq(1, 120, max_new=5)
    again.token_ids[:100] = first.token_ids[:100]
    assert sched.blocks.match_prefix(again) == 96
    sched.add(again)
    prompt = list(again.token_ids)
    outputs, _ = drive(sched, worker=worker)  # the worker checks every key read through the reused blocks
    assert outputs == {"r1": alone(prompt, 5)}
    assert sched.blocks.prefix_cache_hits == 96


def alone(prompt, max_new):
    """What a sequence of this prompt generates alone in a roomy all-full pool."""
    ref = Scheduler(SchedulingPolicy(max_model_len=512), BlockManager(512, BS), eos_token_ids=[EOS])
    s = seq(9, len(prompt), max_new=max_new)
    s.token_ids = list(prompt)
    ref.add(s)
    return drive(ref)[0]["r9"]


def test_a_prefix_whose_window_blocks_were_evicted_is_matched_only_as_far_as_they_go():
    sched = make(64, caching=True)
    first = seq(0, 100, max_new=1)
    sched.add(first)
    worker = GroupedWorker(sched.blocks)
    drive(sched, worker=worker)
    # Evict the sliding group's cached blocks 4 and 5: only a prefix whose window needs neither matches.
    for i in (4, 5):
        key = (1, sched.blocks._hashes(first, 6)[i])
        block = sched.blocks._group_cached.pop(key)
        sched.blocks._block_hash[block] = None
        del sched.blocks._evictable[block]
        sched.blocks._free.append(block)
    again = seq(1, 120, max_new=2)
    again.token_ids[:100] = first.token_ids[:100]
    # 4 blocks (64 tokens): the window before 64 is blocks 1-3, all cached.
    assert sched.blocks.match_prefix(again) == 64
    sched.add(again)
    drive(sched, worker=worker)
    sched.check_invariants()


def test_holes_are_never_hashed_shared_or_released_twice():
    blocks = BlockManager(40, BS, enable_prefix_caching=True, layout=group_layers(windows(6, 3), BS))
    s = seq(0, 200, max_new=1)
    blocks.allocate(s, 200)
    s.num_computed_tokens = 200
    blocks.register_full_blocks(s)
    sliding = blocks.tables(s)[1]
    assert sliding[:10] == [HOLE] * 10 and HOLE not in sliding[10:]
    blocks.register_full_blocks(s)  # again: nothing more released
    blocks.check_invariants([s.block_table])
    fork = seq(1, 200, max_new=1)
    assert blocks.share(fork, s, 192) == 192
    assert blocks.tables(fork)[1][:10] == [HOLE] * 10
    blocks.check_invariants([s.block_table, fork.block_table])
    blocks.free(s)
    blocks.free(fork)
    blocks.check_invariants([])
    assert blocks.num_free_blocks == 40
