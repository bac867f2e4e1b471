"""Automatic prefix caching in the block manager, as plain Python: hits, reference counts, eviction order."""

import pytest

from common.block_hash import hash_block
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence
from tests.unit.fakes import kv_slot, one_each

BS = 4
EOS = 2


def pool(num_blocks=16, caching=True):
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching)


_next_id = iter(range(10**9))


def make_seq(tokens):
    i = next(_next_id)
    return Sequence(i, f"r{i}", list(tokens), len(tokens), 8)


def run_prefill(bm, seq):
    """Admits seq as the scheduler would, computes the rest of its tokens in one step, registers its blocks.

    Returns the number of cached tokens it was admitted with."""
    cached = bm.match_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens, num_cached_tokens=cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return cached


def test_second_sequence_reuses_the_shared_prefix_blocks():
    bm = pool()
    a = make_seq(range(100, 114))  # 3 full blocks + 2 tokens
    assert run_prefill(bm, a) == 0
    b = make_seq([*range(100, 112), 7, 8, 9])  # shares a's 3 full blocks, then differs
    assert bm.match_prefix(b) == 12
    assert run_prefill(bm, b) == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] not in a.block_table
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (14 + 15, 12)


def test_partial_block_match_counts_only_full_blocks():
    bm = pool()
    run_prefill(bm, make_seq(range(100, 112)))
    # Same first block and half of the second: only the first block is reused.
    assert bm.match_prefix(make_seq([100, 101, 102, 103, 104, 105, 0, 0, 1])) == 4


def test_same_block_after_a_different_prefix_is_not_a_hit():
    bm = pool()
    a = make_seq([1, 1, 1, 1, 5, 6, 7, 8, 9])
    run_prefill(bm, a)
    # Block 1 holds the same tokens as a's block 1, but its KV depends on block 0, which differs.
    b = make_seq([3, 3, 3, 3, 5, 6, 7, 8, 9])
    assert bm.match_prefix(b) == 0
    assert hash_block(b"", [1, 2]) != hash_block(hash_block(b"", [0]), [1, 2])


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = pool()
    a = make_seq(range(100, 108))  # exactly 2 blocks
    run_prefill(bm, a)
    a_table = list(a.block_table)
    bm.free(a)
    again = make_seq(range(100, 108))
    # Both blocks are cached, but the last token must run through the model to be sampled from: only the
    # first block is reused, and the second is computed again into a fresh block.
    assert bm.match_prefix(again) == 4
    assert run_prefill(bm, again) == 4
    assert again.block_table[0] == a_table[0] and again.block_table[1] != a_table[1]
    # again's second block duplicates a's, which nobody holds: again's, held, becomes the cached one (a's
    # goes back to the free blocks), so the chain's copies are evicted together; a longer prompt reuses it.
    longer = make_seq(range(100, 109))
    assert run_prefill(bm, longer) == 8
    assert longer.block_table[:2] == [a_table[0], again.block_table[1]]
    bm.free(again)
    assert again.block_table == [] and bm.num_cached_blocks == 2
    assert bm.match_prefix(make_seq([100])) == 0


def test_shared_blocks_are_counted_and_outlive_one_holder():
    bm = pool(num_blocks=8)
    a = make_seq(range(100, 110))
    b = make_seq(range(100, 110))
    run_prefill(bm, a)
    run_prefill(bm, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert bm.num_free_blocks == 8 - 4  # 2 shared + one tail each
    bm.free(a)
    assert bm.num_free_blocks == 8 - 3  # a's tail is free; the shared blocks are still b's
    # A pool-draining allocation cannot take the blocks b still holds.
    hog = make_seq(range(500, 500 + 5 * BS))
    assert bm.allocate(hog, hog.num_tokens)
    assert not set(hog.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(make_seq([9]), 1)
    bm.free(b)
    bm.free(hog)
    assert bm.num_free_blocks == 8


def test_eviction_takes_least_recently_freed_first_and_tail_before_head():
    bm = pool(num_blocks=6)
    old = make_seq(range(100, 108))  # 2 full blocks
    new = make_seq(range(200, 212))  # 3 full blocks
    run_prefill(bm, old)
    run_prefill(bm, new)
    o, n = list(old.block_table), list(new.block_table)
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 5
    # Fresh blocks come first from the block that never held anything, then from the cache: old before
    # new, and within one sequence its tail before its head.
    taken = []
    for _ in range(6):
        s = make_seq([7])
        bm.allocate(s, 1)
        taken.append(s.block_table[0])
    assert taken[0] not in o + n
    assert taken[1:] == [o[1], o[0], n[2], n[1], n[0]]
    assert bm.num_cached_blocks == 0


def test_evicting_a_tail_keeps_the_head_reusable():
    bm = pool(num_blocks=4)
    a = make_seq(range(100, 112))  # 3 full blocks
    run_prefill(bm, a)
    bm.free(a)
    s = make_seq([7, 7, 7, 7, 7])
    bm.allocate(s, 5)  # the never-used block and a's tail
    assert bm.match_prefix(make_seq(range(100, 113))) == 8


def test_hit_refreshes_recency():
    bm = pool(num_blocks=3)
    a = make_seq(range(100, 105))  # 1 full block + 1 token
    b = make_seq(range(200, 205))
    run_prefill(bm, a)
    bm.free(a)  # a's full block is cached; its tail goes to the plain free list
    run_prefill(bm, b)
    bm.free(b)
    # a's block was freed first, so it would be evicted first; a hit and a later free make it the newest.
    a2 = make_seq(range(100, 106))
    assert run_prefill(bm, a2) == 4
    bm.free(a2)
    c = make_seq(range(300, 300 + 3 * BS))
    bm.allocate(c, c.num_tokens)
    bm.free(c)
    assert bm.match_prefix(make_seq(range(100, 106))) == 0
    assert bm.match_prefix(make_seq(range(200, 206))) == 0


def test_blocks_about_to_be_reused_are_not_evicted_to_make_room_for_the_rest():
    bm = pool(num_blocks=3)
    a = make_seq([1, 1, 1, 1])  # its only full block is registered once computed (the cap applies to hits)
    run_prefill(bm, a)
    d = make_seq([3, 3, 3, 3])
    run_prefill(bm, d)
    hit = a.block_table[0]
    bm.free(a)
    bm.free(d)
    # Eviction order now: a's block (oldest), then d's; one block was never used.
    b = make_seq([1, 1, 1, 1, 9, 9, 9, 9, 9, 9, 9])  # hits a's block, needs 2 fresh blocks for the rest
    assert bm.match_prefix(b) == 4
    assert bm.num_free_blocks == 3
    assert bm.can_allocate(b, b.num_tokens, num_cached_tokens=4)
    assert bm.allocate(b, b.num_tokens, num_cached_tokens=4)
    # Taking fresh blocks first would have evicted a's block (the oldest) and reused it for b's tail.
    assert b.block_table[0] == hit
    assert len(set(b.block_table)) == 3
    assert bm.match_prefix(make_seq([3, 3, 3, 3, 3])) == 0  # d's block was the one evicted
    assert bm.num_free_blocks == 0


def test_can_allocate_counts_a_reused_idle_block_once_and_a_held_one_not_at_all():
    bm = pool(num_blocks=4)
    a = make_seq(range(100, 109))  # 2 full blocks + 1 token
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq(range(100, 114))  # 14 tokens: 4 blocks, 2 of them cached and idle
    assert bm.num_free_blocks == 4
    assert bm.can_allocate(b, 14, num_cached_tokens=8)
    assert not bm.can_allocate(b, 14, reserve=1, num_cached_tokens=8)
    assert not bm.can_allocate(b, 17, num_cached_tokens=8)
    assert bm.allocate(b, 14, num_cached_tokens=8)
    bm.free(b)
    c = make_seq(range(100, 109))
    run_prefill(bm, c)  # holds the 2 cached blocks and 1 fresh one
    assert bm.num_free_blocks == 1
    d = make_seq(range(100, 112))  # 3 blocks, 2 of them held by c: needs 1 fresh
    assert bm.can_allocate(d, 12, num_cached_tokens=8)
    assert not bm.can_allocate(d, 12)  # without the hit it needs 3
    assert not bm.allocate(d, 13, num_cached_tokens=8)
    assert d.block_table == [] and bm.num_free_blocks == 1  # all or nothing


def test_a_wrong_claim_of_cached_tokens_is_refused():
    bm = pool()
    run_prefill(bm, make_seq(range(100, 109)))
    s = make_seq(range(100, 109))
    with pytest.raises(ValueError, match="cached"):
        bm.allocate(s, 9, num_cached_tokens=12)
    with pytest.raises(ValueError, match="multiple"):
        bm.can_allocate(s, 9, num_cached_tokens=6)
    with pytest.raises(ValueError):
        pool(caching=False).allocate(make_seq([1, 2, 3, 4, 5]), 5, num_cached_tokens=4)


def test_blocks_are_registered_only_once_their_tokens_are_computed():
    bm = pool()
    a = make_seq(range(100, 114))
    bm.allocate(a, 6)  # a chunk of the prompt
    a.num_computed_tokens = 6
    bm.register_full_blocks(a)
    assert bm.match_prefix(make_seq(range(100, 114))) == 4
    bm.allocate(a, 14)
    a.num_computed_tokens = 14
    bm.register_full_blocks(a)
    assert bm.match_prefix(make_seq(range(100, 114))) == 12
    assert bm.num_cached_blocks == 3


def test_preempted_sequence_hits_its_own_blocks_including_generated_tokens():
    bm = pool(num_blocks=8)
    s = make_seq(range(100, 106))
    run_prefill(bm, s)
    for t in range(50, 57):  # decode 7 tokens: 13 tokens in all, 12 computed
        s.token_ids.append(t)
        bm.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens - 1
        bm.register_full_blocks(s)
    table = list(s.block_table)
    bm.free(s)  # preemption: recompute later
    s.num_computed_tokens = 0
    assert bm.num_free_blocks == 8
    cached = bm.match_prefix(s)
    assert cached == 12  # three full blocks, the third made of generated tokens
    assert bm.allocate(s, s.num_tokens, num_cached_tokens=cached)
    assert s.block_table[:3] == table[:3]
    bm.free(s)
    assert bm.num_free_blocks == 8


def test_caching_off_behaves_as_before():
    bm = pool(num_blocks=6, caching=False)
    a = make_seq(range(100, 109))
    assert run_prefill(bm, a) == 0
    assert a.block_table == [0, 1, 2]
    assert bm.match_prefix(make_seq(range(100, 109))) == 0
    assert bm.num_cached_blocks == 0
    bm.free(a)
    b = make_seq(range(100, 109))
    bm.allocate(b, 9)
    # No cache: the lowest free blocks, so a's freed ones, not a reuse of its prefix (nothing matched).
    assert b.block_table == [0, 1, 2]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


# ---- the real Scheduler, with the block-manager calls prefix caching needs ----


def fake_model(s: Sequence) -> int:
    return 10 + (sum(s.token_ids) * 31 + len(s.token_ids)) % 90


def run_checking_kv(sched, arrivals, max_steps=10_000):
    """Drives the scheduler with a fake KV cache in which each slot records the prefix its KV was computed
    from; every step checks that each scheduled sequence's context reads back its own prefix, as a real
    attention kernel would read it. arrivals: {step: [sequences added before that step]}."""
    bm = sched.blocks
    kv: list[tuple | None] = [None] * (bm.num_blocks * bm.block_size)
    outputs: dict[str, list[int]] = {}
    for step in range(max_steps):
        for s in arrivals.get(step, []):
            sched.add(s)
        if not sched.has_unfinished and step > max(arrivals):
            return outputs
        out = sched.schedule()
        sampled = []
        for item in out.scheduled:
            s, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            for p in range(start, end):
                kv[kv_slot(s.block_table, p, bm.block_size)] = tuple(s.token_ids[: p + 1])
            for p in range(end):
                assert kv[kv_slot(s.block_table, p, bm.block_size)] == tuple(s.token_ids[: p + 1]), (
                    f"{s.request_id} reads stale KV at {p}"
                )
            if item.num_samples:
                sampled.append(fake_model(s))
        for u in sched.update(out, one_each(sampled)):
            outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
        sched.check_invariants()
    raise AssertionError("did not finish")


def workload():
    system = [10 + j % 40 for j in range(3 * 16 + 5)]  # a shared "system prompt"
    arrivals = {}
    for i in range(10):
        prompt = system + [60 + (i * 7 + j) % 30 for j in range(5 + 9 * (i % 4))]
        if i in (6, 7):
            prompt = list(arrivals[0][0].token_ids[:53])  # the same prompt again
        s = Sequence(i, f"r{i}", prompt, len(prompt), 30, ignore_eos=True)
        arrivals.setdefault(0 if i < 3 else 4 * i, []).append(s)
    return arrivals


@pytest.mark.parametrize("num_blocks", [200, 14])
def test_scheduler_outputs_equal_with_caching_on_and_off(num_blocks):
    def go(caching):
        policy = SchedulingPolicy(max_num_batched_tokens=64, max_model_len=256)
        sched = Scheduler(
            policy, BlockManager(num_blocks, 16, enable_prefix_caching=caching), eos_token_ids=[EOS]
        )
        arrivals = workload()
        outputs = run_checking_kv(sched, arrivals)
        # What Usage.cached_tokens says: the hit at each request's first admission.
        sched.cached_tokens = {s.request_id: s.num_cached_tokens for wave in arrivals.values() for s in wave}
        sched.prompt_tokens = sum(s.num_prompt_tokens for wave in arrivals.values() for s in wave)
        return outputs, sched

    off, off_sched = go(False)
    on, on_sched = go(True)
    assert on == off and len(on) == 10 and all(len(v) == 30 for v in on.values())
    assert on_sched.blocks.prefix_cache_hits > 0 and off_sched.blocks.prefix_cache_hits == 0
    assert on_sched.cached_tokens["r5"] == 48  # the three full blocks of the system prompt
    # Each client request is looked up once, at its first admission: preemptions do not count again.
    assert on_sched.blocks.prefix_cache_hits == sum(on_sched.cached_tokens.values())
    assert on_sched.blocks.prefix_cache_queries == on_sched.prompt_tokens
    if num_blocks == 14:
        assert on_sched.num_preemptions > 0
    assert on_sched.blocks.num_free_blocks == num_blocks
    assert off_sched.blocks.num_free_blocks == num_blocks


def test_the_lowest_free_blocks_are_handed_out_first():
    # What keeps the blocks in use a compact prefix of the cache (the CPU attention reads only that).
    bm = pool(num_blocks=8, caching=False)
    a, b, c = (make_seq(range(i, i + n)) for i, n in ((100, 3 * BS), (200, 3 * BS), (300, 2 * BS)))
    for s in (a, b, c):
        bm.allocate(s, s.num_tokens)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4, 5], [6, 7])
    bm.free(b)
    bm.free(a)
    d = make_seq(range(400, 400 + 3 * BS))
    bm.allocate(d, d.num_tokens)
    assert d.block_table == [0, 1, 2]
    bm.check_invariants()
