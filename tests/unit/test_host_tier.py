"""The prefix cache's host tier (--host-prefix-cache), as plain Python: no torch, no gRPC.

A fake worker keeps a token id in every device and host KV slot and makes each step's copies as a shard
worker does (swap-outs, then swap-ins, then the step's tokens), and checks that every sequence's context
read back through its block table is its tokens: a block restored from the wrong host block, a copy
made after its source was overwritten, or a host block reused too early shows up as a wrong token."""

import random

from common.block_hash import block_hashes
from scheduler.batch import StepBuilder
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence
from scheduler.swap import HostBlockPool
from tests.unit.fakes import step_arrays
from tests.unit.test_scheduler import BS, EOS
from tests.unit.test_swap import FakeWorker


def make(num_blocks, num_host_blocks, tier=True, **policy):
    policy.setdefault("max_model_len", 512)
    host = HostBlockPool(num_host_blocks, cache_prefixes=tier) if num_host_blocks else None
    blocks = BlockManager(num_blocks, BS, enable_prefix_caching=True, host_tier=host)
    return Scheduler(SchedulingPolicy(**policy), blocks, eos_token_ids=[EOS], host_blocks=host)


class Driver:
    """A scheduler, a FakeWorker and a StepBuilder, stepped like the engine; records every step."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.worker = FakeWorker(
            sched.blocks.num_blocks, sched.host_blocks.num_blocks if sched.host_blocks else 0
        )
        self.builder = StepBuilder()
        self.seqs: dict[int, Sequence] = {}
        self.outputs: dict[str, list[int]] = {}
        self.steps = []
        self._next = 0

    def add(self, tokens, max_new=4) -> Sequence:
        s = Sequence(self._next, f"r{self._next}", list(tokens), len(tokens), max_new)
        self._next += 1
        self.seqs[s.seq_id] = s
        self.sched.add(s)
        return s

    def step(self):
        out = self.sched.schedule()
        self.steps.append(out)
        for u in self.sched.update(out, self.worker.step(self.builder.build(out), self.seqs)):
            self.outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
        self.sched.check_invariants()
        return out

    def drain(self):
        while self.sched.has_unfinished:
            self.step()
            assert len(self.steps) < 20_000

    def lose_workers(self):
        """Every rank restarts: fresh device and host caches, and pools to match."""
        s = self.sched
        s.requeue_all()
        host = HostBlockPool(s.host_blocks.num_blocks, cache_prefixes=s.host_blocks.cache_prefixes)
        s.replace_blocks(BlockManager(s.blocks.num_blocks, BS, True, host), host)
        self.worker = FakeWorker(s.blocks.num_blocks, host.num_blocks)
        self.builder = StepBuilder()


def prompt(base, n):
    return [10 + (base * 7 + j) % 80 for j in range(n)]


def test_an_evicted_prefix_comes_back_from_host_memory_without_a_prefill():
    def go(tier):
        d = Driver(make(num_blocks=8, num_host_blocks=16, tier=tier))
        p = prompt(1, 3 * BS + 5)  # 3 full blocks, then part of one
        d.add(p)
        d.drain()
        for i in (2, 3, 4):  # other prompts take every device block: p's are evicted
            d.add(prompt(i, 3 * BS + 5))
            d.drain()
        assert not set(d.sched.blocks.cached_hashes()) & set(block_hashes(p, BS, 3))
        again = d.add(p[: 3 * BS] + prompt(9, 7))  # the same 3 blocks, a new question
        out = d.step()
        table = list(again.block_table)
        d.drain()
        return d, again, out, table

    d, again, out, table = go(tier=True)
    item = next(s for s in out.scheduled if s.seq is again)
    # The step computes only the tokens past the prefix: its 3 blocks came back from host memory.
    assert item.num_new_tokens == again.num_prompt_tokens - 3 * BS and again.num_cached_tokens == 3 * BS
    assert len(out.swap_in) == 3 and [dev for _, dev in out.swap_in] == table[:3]
    b = d.sched.blocks
    assert (b.host_cache_hits, b.host_tier.restored_blocks) == (3 * BS, 3)
    assert b.host_tier.offloaded_blocks >= 3 and sum(len(s.swap_out) for s in d.steps) >= 3
    # The same tokens as recomputing them (the tier off: a full prefill).
    off, again_off, out_off, _ = go(tier=False)
    assert next(s for s in out_off.scheduled if s.seq is again_off).num_new_tokens == again.num_prompt_tokens
    assert off.outputs == d.outputs and off.sched.blocks.host_tier is None and not out_off.swap_in


def test_the_host_tier_evicts_its_least_recently_used_block_when_full():
    host = HostBlockPool(2, cache_prefixes=True)
    assert host.offload(b"a", 5) == (5, 0) and host.offload(b"b", 6) == (6, 1)
    host.begin_step()
    assert host.offload(b"a", 7) is None  # already there: no copy, and now the most recent
    assert host.offload(b"c", 8) == (8, 1)  # b, the least recently used, goes
    assert set(host.cached_hashes()) == {b"a", b"c"}
    events = host.events.take()
    assert set(events.stored) == {b"a", b"c"} and events.removed == ()  # b's store and removal net out
    # A block this step's copies use is not taken: c was written, a is being restored.
    assert host.restore(b"a") == 0
    assert host.offload(b"d", 9) is None and set(host.cached_hashes()) == {b"a", b"c"}
    host.begin_step()
    assert host.offload(b"d", 9) == (9, 1)  # c was the least recently used
    host.check_invariants([])


def test_preempted_sequences_take_host_blocks_from_the_cache():
    host = HostBlockPool(3, cache_prefixes=True)
    host.offload(b"a", 1)
    host.offload(b"b", 2)
    host.begin_step()
    assert host.can_swap_out(3) and not host.can_swap_out(4)
    assert sorted(h for _, h in host.swap_out(7, [10, 11, 12])) == [0, 1, 2]
    events = host.events.take()
    assert host.cached_hashes() == [] and events.stored == events.removed == ()  # stored, then removed
    host.check_invariants([7])


def test_host_blocks_a_swap_in_reads_are_not_written_in_the_same_step():
    """The ranks make a step's swap-outs before its swap-ins: a host block released by a swap-in and
    taken by an offload in the same step would be overwritten before it is read."""
    host = HostBlockPool(2, cache_prefixes=True)
    host.swap_out(7, [10, 11])
    host.begin_step()
    assert host.swap_in(7, [3, 4]) == [(0, 3), (1, 4)]
    assert host.num_free_blocks == 2 and not host.can_swap_out(1)
    assert host.offload(b"a", 5) is None  # nothing may be written this step
    host.begin_step()
    assert host.offload(b"a", 5) == (5, 0)
    host.check_invariants([])


def test_a_tier_that_is_off_keeps_nothing():
    host = HostBlockPool(4)
    assert host.offload(b"a", 1) is None and host.num_cached_blocks == 0
    assert BlockManager(8, BS, True, host).host_tier is None


def test_random_run_with_a_small_device_and_host_gives_the_roomy_outputs_and_recovers_a_loss():
    """Many requests over a few shared prefixes through 14 device and 10 host blocks (so both tiers
    evict, preempted sequences swap out into the tier's room, and prefixes come back from it), the
    ranks lost midway: every step's KV read back is each sequence's tokens, and the outputs are those
    of a cache large enough for everything."""
    rng = random.Random(3)
    prefixes = [prompt(i, rng.choice((2, 3, 4)) * BS) for i in range(5)]
    workload = []
    for i in range(60):
        p = rng.choice(prefixes)[: rng.randrange(1, 5) * BS] + prompt(100 + i, rng.randrange(1, 20))
        workload.append((p, rng.randrange(1, 12)))

    def go(num_blocks, num_host_blocks, lose_at=None):
        d = Driver(make(num_blocks, num_host_blocks, max_num_seqs=4))
        pending = list(workload)
        while pending or d.sched.has_unfinished:
            for p, n in pending[:2]:  # two arrive per step
                d.add(p, n)
            del pending[:2]
            if len(d.steps) == lose_at:
                d.lose_workers()
            d.step()
            assert len(d.steps) < 20_000
        return d

    roomy = go(400, 0)
    small = go(14, 10)
    h = small.sched.host_blocks
    assert h.restored_blocks > 0 and h.offloaded_blocks > h.num_blocks  # the tier filled and evicted
    assert small.sched.num_preemptions > 0
    assert small.outputs == roomy.outputs
    # Lose the ranks while the host tier holds blocks: fresh pools, everything recomputed, same tokens,
    # and the new tier serves prefixes again.
    lose_at = next(i for i in range(20, len(small.steps)) if small.steps[i].swap_out)
    lost = go(14, 10, lose_at=lose_at)
    assert lost.outputs == roomy.outputs and lost.sched.host_blocks.restored_blocks > 0


def test_step_request_carries_offloads_and_restores():
    d = Driver(make(num_blocks=4, num_host_blocks=8))
    d.add(prompt(1, 2 * BS + 1), max_new=1)
    d.drain()
    d.add(prompt(2, 3 * BS + 1), max_new=1)  # needs all 4 blocks: the first's 2 cached ones are evicted
    evicting = d.step()
    assert len(evicting.swap_out) == 2
    d.drain()
    d.add(prompt(1, 2 * BS) + [5, 6], max_new=1)
    plan = d.builder.build(d.sched.schedule())
    assert sorted(plan.swap_in_src) == sorted(host for _, host in evicting.swap_out)
    assert step_arrays(plan)["query_lens"] == [2]  # two new tokens; the two blocks came from host memory
