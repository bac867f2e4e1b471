"""The pool of KV-cache blocks, which sequence holds which, and (optionally) which full blocks can be reused.

Plain Python: the workers hold the tensors; this decides which block a token's key and value go to.

Automatic prefix caching and its host tier: scheduler/prefix_cache.py (the part of this class that names
blocks by their content).

Layer groups (scheduler/kv_cache_spec.py): a model whose layers keep different things (full attention,
sliding windows) has one block table per group and sequence, every group drawing on this one pool.
Group 0's table is `seq.block_table` (the one the prefix cache names to the routers and swap copies
first); the others are kept here (`tables`). After each step (`register_full_blocks`) a sliding group's
blocks that no later query reads go back to the pool, and a HOLE takes their place in the table: a hole is
never hashed, shared, swapped or freed. A prefix match reuses group 0's blocks and, in every other group,
the cached blocks inside the window before the match's end (holes before it), so a group's cached block
only ever serves the very prefix it was computed for.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from common.kv_cache_spec import HOLE, FullAttentionSpec, KVCacheGroup, KVCacheLayout, blocks_for
from common.kv_events import KvEventLog
from scheduler.prefix_cache import PrefixCache
from scheduler.sequence import Sequence
from scheduler.state_slots import StateSlots
from scheduler.swap import HostBlockPool

__all__ = ["HOLE", "BlockManager", "blocks_for"]


class BlockManager(PrefixCache):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        host_tier: HostBlockPool | None = None,
        layout: KVCacheLayout | None = None,
        state: StateSlots | None = None,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = layout or KVCacheLayout((KVCacheGroup(FullAttentionSpec(block_size), ()),), 1)
        self.specs = [g.spec for g in self.layout.groups]
        if any(spec.block_size != block_size for spec in self.specs):
            raise ValueError(f"every KV cache group must have blocks of {block_size} tokens")
        # Per live sequence holding blocks: the block tables of groups 1.. (group 0's is seq.block_table).
        self._tables: dict[int, list[list[int]]] = {}
        # Recurrent-state slots (linear-attention layers): one per sequence holding blocks. The state
        # after a prefix is not kept, so such a model reuses no cached prefix (nor a fork's blocks).
        self.state = state
        self.enable_prefix_caching = enable_prefix_caching and state is None
        # Blocks held by no sequence and holding nothing reusable, a min-heap: the lowest is handed out
        # first, so the blocks in use stay a compact prefix of the cache while it is not full. The CPU
        # attention hands its kernel only the cache up to the highest block a step reads, whose cost
        # grows with that length (shard_worker/attention/flex.py); FIFO reuse cycled through the whole
        # cache and kept it at the maximum.
        self._free: list[int] = list(range(num_blocks))
        # Cached blocks held by no sequence, in eviction order (first = next to evict).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_count = [0] * num_blocks
        # What a cached block is cached under: group 0's hash, or (group, hash) for the other groups,
        # whose blocks are matched only here and never named to the routers nor kept in the host tier.
        self._block_hash: list[bytes | tuple[int, bytes] | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> the block holding that prefix's last block of KV
        self._group_cached: dict[tuple[int, bytes], int] = {}
        # Per live sequence (seq_id): keys of its full blocks computed so far (tokens only grow, so they stay
        # valid), and how many of its leading blocks register_full_blocks has already handled.
        self._seq_hashes: dict[int, list[bytes]] = {}
        self._seq_registered: dict[int, int] = {}
        # Metrics: tokens looked up at admission, and how many of them were found cached here; of the
        # tokens not found here, those looked up in the host tier and found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_cache_queries = 0
        self.host_cache_hits = 0
        # The host tier of the prefix cache, when there is one (and this pool caches prefixes).
        on = enable_prefix_caching and host_tier is not None and host_tier.cache_prefixes
        self.host_tier = host_tier if on else None
        # This step's block copies: (device, host) evicted blocks kept in the host tier, and
        # (host, device) host-tier blocks brought back.
        self.copies_out: list[tuple[int, int]] = []
        self.copies_in: list[tuple[int, int]] = []
        # Hashes stored in and evicted from the prefix cache since the engine last took them; a new
        # pool starts with a reset (routers forget what the replica held before).
        self.events = KvEventLog()
        # Async scheduling (scheduler/overlap.py): per sequence, the last step sent to the ranks and not
        # returned that computes for it; blocks such a sequence lets go of wait in _deferred, with that
        # step, until it returned. Empty in the serial loop: every free is at once.
        self._in_flight: dict[int, int] = {}
        self._deferred: list[tuple[int, list[int]]] = []
        self._deferred_slots: list[tuple[int, int]] = []  # (step, state slot), the same way

    @classmethod
    def of(cls, capacity, block_size: int, enable_prefix_caching: bool, host_tier) -> BlockManager:
        """The pool the ranks settled on (scheduler/capacity.py), laid out in their layer groups."""
        spec = capacity.state
        state = None if spec is None else StateSlots(spec.num_slots, spec.num_host_slots)
        return cls(capacity.num_blocks, block_size, enable_prefix_caching, host_tier, capacity.layout, state)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: empty ones plus cached ones that nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (device, host) offloads and (host, device) restores, and starts the next step's."""
        copies = self.copies_out, self.copies_in
        self.copies_out, self.copies_in = [], []
        return copies

    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block table in every group (group 0's is seq.block_table)."""
        return [seq.block_table, *self._tables.get(seq.seq_id, [[] for _ in self.specs[1:]])]

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so that its first num_tokens tokens have a slot (in every group; a
        window's holes would need fewer, so this never underestimates)."""
        n = blocks_for(num_tokens, self.block_size)
        return sum(max(0, n - len(t)) for t in self.tables(seq))

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """The blocks holding seq's computed tokens that later queries read, group after group: what a
        swap-out copies, and, once seq has fresh blocks again, where a swap-in puts them back."""
        nc = seq.num_computed_tokens
        end = blocks_for(nc, self.block_size)
        out = []
        for spec, table in zip(self.specs, self.tables(seq), strict=True):
            kept = table[spec.first_needed_block(nc) : end]
            if HOLE in kept:
                raise RuntimeError(f"seq {seq.seq_id} lost a block its window still reads")
            out += kept
        return out

    def register_full_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Makes seq's full, computed blocks reusable by later requests, then lets go of the blocks no
        later query of seq reads (outside every sliding window).

        Call after a step's results are applied (num_computed_tokens advanced by the step, so the KV of
        those tokens is written) and before seq's blocks are freed. Only blocks whose block_size tokens all
        lie below num_computed_tokens (default: seq.num_computed_tokens) are registered: their tokens and
        KV never change again. A block whose prefix another block already caches (two requests computed
        it at once) stays unregistered and is freed as plain memory. Registering comes first, so a block
        let go of stays cached (evictable) like any other."""
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self._register(seq, num_computed_tokens)
        self._release_outside_windows(seq, num_computed_tokens)

    def _release_outside_windows(self, seq: Sequence, num_computed_tokens: int) -> None:
        released = []
        for spec, table in zip(self.specs, self.tables(seq), strict=True):
            for i in range(min(spec.first_needed_block(num_computed_tokens), len(table))):
                if table[i] != HOLE:
                    released.append(table[i])
                    table[i] = HOLE
        if released:
            self._let_go(seq.seq_id, released)

    # ---- allocation ----

    def can_allocate(
        self, seq: Sequence, num_tokens: int, reserve: int = 0, num_cached_tokens: int = 0
    ) -> bool:
        """Whether seq can get slots for its first num_tokens tokens and still leave reserve blocks free.

        num_cached_tokens: at admission, the leading tokens to be taken from the prefix cache
        (match_prefix's answer); those blocks cost nothing new, but a cached block that nobody holds
        stops counting as free once it is reused."""
        matched, others, device = self._reused(seq, num_cached_tokens)
        return self._fits(seq, num_tokens, reserve, matched, others, device)

    def _fits(self, seq, num_tokens, reserve, matched, others, device) -> bool:
        """device: device blocks seq reuses (blocks restored from the host tier need fresh ones)."""
        if self.state is not None and self.state.slot_of(seq.seq_id) is None and not self.state.num_free:
            return False
        taken_from_free = sum(1 for b in device if self._ref_count[b] == 0)
        fresh = len(matched) - sum(b is not None for _, b in matched)  # restored from the host tier
        start = max(seq.num_computed_tokens, len(matched) * self.block_size)
        for spec, table, prefix in zip(self.specs, self.tables(seq), [matched, *others], strict=True):
            fresh += len(self._new_indices(spec, table, len(prefix), num_tokens, start))
        return fresh + reserve <= self.num_free_blocks - taken_from_free

    def _new_indices(self, spec, table: list[int], num_prefix: int, num_tokens: int, start: int) -> range:
        """The table indices a group gives fresh blocks to: past the table and the prefix it reuses,
        within the window of queries from position start on (those before it are holes)."""
        first = max(len(table) + num_prefix, spec.first_needed_block(start))
        return range(first, max(first, blocks_for(num_tokens, self.block_size)))

    def allocate(
        self, seq: Sequence, num_tokens: int, num_cached_tokens: int = 0, count_query: bool = True
    ) -> bool:
        """Gives seq slots for its first num_tokens tokens; all or nothing.

        num_cached_tokens (admission only, see can_allocate): seq's block table starts with the cached
        blocks of that prefix, and the scheduler sets seq.num_computed_tokens to it. count_query: this
        admission counts in the prefix-cache metrics (a client request's first; not a sequence coming
        back after a preemption or a swap, which would count the same prompt again)."""
        matched, others, reused = self._reused(seq, num_cached_tokens)
        if not self._fits(seq, num_tokens, 0, matched, others, reused):
            return False
        if self.enable_prefix_caching and not seq.block_table:
            if count_query:
                on_device = sum(b is not None for _, b in matched)
                self._count_query(seq.num_tokens, on_device, len(matched) - on_device)
            self._seq_registered[seq.seq_id] = len(matched)
        # Reused blocks leave the evictable set, and host blocks to restore are kept, before any fresh
        # block is taken: taking fresh blocks (which may evict, and offload to the host tier) can never
        # evict the very blocks this sequence is about to reuse.
        for block in reused:
            if self._ref_count[block] == 0:
                del self._evictable[block]
            self._ref_count[block] += 1
        restore = {h: self.host_tier.restore(h) for h, b in matched if b is None}
        for h, block in matched:
            if block is None:  # a fresh block, registered now: the copy lands before the forward
                block = self._take_fresh_block()
                self._block_hash[block] = h
                self._cached[h] = block
                self.events.stored(h)
                self.copies_in.append((restore[h], block))
            seq.block_table.append(block)
        start = max(seq.num_computed_tokens, num_cached_tokens)
        tables = self.tables(seq)
        for spec, table, prefix in zip(self.specs, tables, [[], *others], strict=True):
            table += prefix
            new = self._new_indices(spec, table, 0, num_tokens, start)
            table += [HOLE] * (new.start - len(table)) + [self._take_fresh_block() for _ in new]
        if len(tables) > 1:
            self._tables[seq.seq_id] = seq.group_tables = tables[1:]
        if self.state is not None:
            seq.state_slot = self.state.take(seq.seq_id)
        return True

    def share(self, seq: Sequence, source: Sequence, num_tokens: int) -> int:
        """Gives seq (holding no blocks, with the same leading tokens) source's blocks of its first
        num_tokens tokens, which source has computed (scheduler/forks.py): their reference counts go up.
        Whole blocks only, so they never change again. Returns the tokens they hold."""
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id} already holds blocks")
        if self.state is not None:  # the state after the shared blocks is not kept
            return 0
        num_blocks = min(num_tokens, source.num_computed_tokens, len(source.block_table) * self.block_size)
        num_blocks //= self.block_size
        tables = [t[:num_blocks] for t in self.tables(source)]
        for block in (b for t in tables for b in t if b != HOLE):
            self._ref_count[block] += 1
        seq.block_table = tables[0]
        if len(tables) > 1:
            self._tables[seq.seq_id] = seq.group_tables = tables[1:]
        return num_blocks * self.block_size

    def _take_fresh_block(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._block_hash[block]
            self._block_hash[block] = None
            if isinstance(h, tuple):  # another group's: known here only
                del self._group_cached[h]
            else:
                del self._cached[h]
                self.events.removed(h)
                copy = None if self.host_tier is None else self.host_tier.offload(h, block)
                if copy is not None:  # read before this step's forward (and swap-ins) write the block
                    self.copies_out.append(copy)
        self._ref_count[block] = 1
        return block

    def truncate(self, seq: Sequence, num_tokens: int) -> int:
        """Returns seq's blocks past those its first num_tokens tokens need (slots of proposed tokens
        that were rejected), and how many. Such blocks hold no computed full block, so none is
        registered or shared."""
        keep = blocks_for(num_tokens, self.block_size)
        dropped = max(0, len(seq.block_table) - keep)
        for table in self.tables(seq):
            while len(table) > keep:
                block = table.pop()
                if block == HOLE:
                    continue
                if self._ref_count[block] != 1 or self._block_hash[block] is not None:
                    raise RuntimeError(f"block {block} past seq {seq.seq_id}'s tokens is shared or cached")
                self._ref_count[block] = 0
                heapq.heappush(self._free, block)
        return dropped

    def free(self, seq: Sequence) -> None:
        """Releases seq's hold on its blocks (finish, abort or preemption). Cached blocks that nobody holds
        any more stay reusable until evicted; the sequence's tail goes first in eviction order. While a
        step in flight computes for seq, its blocks are released only once that step returned."""
        tables = self.tables(seq)
        seq.block_table, seq.group_tables = [], []
        self._tables.pop(seq.seq_id, None)
        self._seq_hashes.pop(seq.seq_id, None)
        self._seq_registered.pop(seq.seq_id, None)
        # Group after group, each tail first: the tail is evicted before the head.
        self._let_go(seq.seq_id, [b for t in reversed(tables) for b in t if b != HOLE])
        slot = None if self.state is None else self.state.release(seq.seq_id)
        seq.state_slot = None
        if slot is not None:
            step = self._in_flight.get(seq.seq_id)
            if step is None:
                self.state.put_back(slot)
            else:  # the step in flight writes its state there
                self._deferred_slots.append((step, slot))

    def _let_go(self, seq_id: int, blocks: list[int]) -> None:
        """seq's hold on these blocks ends: now, or once the step in flight that reads them returned."""
        step = self._in_flight.get(seq_id)
        if step is not None:
            self._deferred.append((step, blocks))
            return
        self._drop(blocks)

    def _drop(self, table: list[int]) -> None:
        for block in reversed(table):
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0 and self._block_hash[block] is not None:
                self._evictable[block] = None
        for b in table:
            if self._ref_count[b] == 0 and self._block_hash[b] is None:
                heapq.heappush(self._free, b)

    def step_sent(self, step_id: int, seq_ids) -> None:
        """Async scheduling: step step_id, which computes for these sequences, went to the ranks."""
        for seq_id in seq_ids:
            self._in_flight[seq_id] = step_id

    def step_returned(self, step_id: int | None = None) -> None:
        """Steps up to step_id returned (None: every step, or none will: the ranks were lost): the
        blocks they kept from the pool go back to it."""
        done = (lambda k: True) if step_id is None else (lambda k: k <= step_id)
        self._in_flight = {s: k for s, k in self._in_flight.items() if not done(k)}
        for _, table in [d for d in self._deferred if done(d[0])]:
            self._drop(table)
        self._deferred = [d for d in self._deferred if not done(d[0])]
        for _, slot in [d for d in self._deferred_slots if done(d[0])]:
            self.state.put_back(slot)
        self._deferred_slots = [d for d in self._deferred_slots if not done(d[0])]

    def check_invariants(self, tables=None) -> None:
        """Raises AssertionError unless the accounting adds up: every block is exactly one of free
        (held by nobody, caching nothing), evictable (held by nobody, caching a prefix) or held (its
        reference count > 0); the prefix map and the blocks' hashes agree; and, given the block tables
        of every sequence holding blocks, each block's reference count is how many tables hold it (those of
        frees deferred while a step in flight uses them counted too)."""
        free, evictable = list(self._free), list(self._evictable)
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(free) & set(evictable), "a block is both free and evictable"
        held = [b for b in range(self.num_blocks) if self._ref_count[b] > 0]
        assert len(free) + len(evictable) + len(held) == self.num_blocks, (
            f"free {len(free)} + evictable {len(evictable)} + held {len(held)} != {self.num_blocks} blocks"
        )
        for b in free:
            assert self._ref_count[b] == 0 and self._block_hash[b] is None, f"free block {b} is in use"
        for b in evictable:
            assert self._ref_count[b] == 0 and self._block_hash[b] is not None, f"block {b} is not evictable"
        for h, b in [*self._cached.items(), *self._group_cached.items()]:
            assert self._block_hash[b] == h, f"block {b} is cached under another hash"
        hashed = sum(h is not None for h in self._block_hash)
        assert hashed == len(self._cached) + len(self._group_cached), "a hashed block is not cached"
        if tables is not None:
            counts = [0] * self.num_blocks
            others = [t for ts in self._tables.values() for t in ts]
            for table in [*tables, *others, *(t for _, t in self._deferred)]:
                for b in table:
                    if b != HOLE:
                        counts[b] += 1
            assert counts == self._ref_count, "reference counts differ from the tables holding the blocks"
        if self.state is not None:
            self.state.check_invariants(deferred=[slot for _, slot in self._deferred_slots])

    def counts(self) -> dict[str, int]:
        """The block and prefix-cache counts of a SchedulerSnapshot (scheduler/plan.py)."""
        tier = self.host_tier
        return dict(
            kv_blocks_total=self.num_blocks,
            kv_blocks_free=self.num_free_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_blocks=self.num_cached_blocks,
            host_cache_queries=self.host_cache_queries,
            host_cache_hits=self.host_cache_hits,
            host_cache_blocks=0 if tier is None else tier.num_cached_blocks,
            offloaded_blocks=0 if tier is None else tier.offloaded_blocks,
            restored_blocks=0 if tier is None else tier.restored_blocks,
        )
