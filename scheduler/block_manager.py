"""The pool of KV-cache blocks, which sequence holds which, and (optionally) which full blocks can be reused.

Plain Python: the workers hold the tensors; this decides which block a token's key and value go to.

Automatic prefix caching (enable_prefix_caching=True): a block whose block_size tokens are all computed is
registered under a hash chained over its parent block's hash, its own tokens and the sequence's LoRA adapter
(common/block_hash.py, the one the router hashes prompts with), so the hash names the whole prefix up to and
including the block (under that adapter). Each
block registered and each cached block evicted goes into `events` (common/kv_events.py), which the engine
sends to the routers once per step: their index of what this replica holds. A sequence being admitted reuses
the registered blocks of its longest cached prefix instead of computing them again. Blocks are reference-
counted: a block held by any sequence is never evicted nor handed out for other content. When its count
drops to 0 a registered block stays cached and evictable; a fresh block is taken first from blocks that hold
nothing reusable, then by evicting the least recently freed cached block (of those freed together, a
sequence's tail before its head, because the head is the part other requests are likelier to share).

How the scheduler drives it:
- admission (a waiting sequence, which holds no blocks):
      num_cached = match_prefix(seq)
      num_new = min(seq.num_tokens - num_cached, budget)
      if can_allocate(seq, num_cached + num_new, reserve, num_cached_tokens=num_cached):
          allocate(seq, num_cached + num_new, num_cached_tokens=num_cached)
          seq.num_computed_tokens = num_cached
- running sequences: allocate(seq, num_tokens) as before.
- after each step, for every scheduled sequence still holding its blocks, right after its
  num_computed_tokens has been advanced by the step and before it may be freed for finishing:
      register_full_blocks(seq)
- preemption, finish and abort: free(seq), as before.
With caching off, match_prefix returns 0 and register_full_blocks does nothing, so the same calls work.

Host tier (host_tier, scheduler/swap.py, when it caches prefixes): a cached block evicted here is
copied to host memory first (the copy goes into `copies_out`), and a prefix match goes on past the
device's blocks into the host tier's: each block found only there gets a fresh device block, registered
at once, and a copy back (`copies_in`). Both lists are the step's, made by every rank before its
forward (swap-outs first); the scheduler takes them with `take_copies` when the step is planned.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict

from common.block_hash import adapter_extra, block_hashes, matchable_blocks
from common.kv_events import KvEventLog, KvEvents
from scheduler.sequence import Sequence
from scheduler.swap import HostBlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        host_tier: HostBlockPool | None = None,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks held by no sequence and holding nothing reusable, a min-heap: the lowest is handed out
        # first, so the blocks in use stay a compact prefix of the cache while it is not full. The CPU
        # attention hands its kernel only the cache up to the highest block a step reads, whose cost
        # grows with that length (shard_worker/attention/flex.py); FIFO reuse cycled through the whole
        # cache and kept it at the maximum.
        self._free: list[int] = list(range(num_blocks))
        # Cached blocks held by no sequence, in eviction order (first = next to evict).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_count = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> the block holding that prefix's last block of KV
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

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: empty ones plus cached ones that nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds on the device."""
        return list(self._cached)

    def take_events(self) -> KvEvents:
        """What both tiers stored and removed since the last take (reset: a new pool, snapshot due)."""
        events = self.events.take()
        if self.host_tier is None:
            return events
        host = self.host_tier.events.take()
        return dataclasses.replace(events, host_stored=host.stored, host_removed=host.removed)

    def snapshot_events(self) -> KvEvents:
        """Everything both tiers hold, as a snapshot (a router's first message)."""
        host = () if self.host_tier is None else tuple(self.host_tier.cached_hashes())
        return KvEvents(stored=tuple(self._cached), host_stored=host, reset=True)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (device, host) offloads and (host, device) restores, and starts the next step's."""
        copies = self.copies_out, self.copies_in
        self.copies_out, self.copies_in = [], []
        return copies

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so that its first num_tokens tokens have a slot."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    # ---- prefix cache ----

    def match_prefix(self, seq: Sequence) -> int:
        """How many leading tokens of seq (which holds no blocks yet) already have their KV cached.

        Full blocks only, and never every token: the last one is always computed so that the step
        yields logits to sample from. Changes nothing."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        return len(self._matched_blocks(seq)) * self.block_size

    def _matched_blocks(self, seq: Sequence) -> list[tuple[bytes, int | None]]:
        """(hash, device block) of each leading block of seq cached in either tier; None for a block
        only the host tier holds."""
        max_blocks = matchable_blocks(seq.num_tokens, self.block_size)
        matched = []
        for h in self._hashes(seq, max_blocks):
            block = self._cached.get(h)
            if block is None and not (self.host_tier is not None and self.host_tier.has(h)):
                break
            matched.append((h, block))
        return matched

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        known = self._seq_hashes.get(seq.seq_id, [])
        if len(known) < num_full_blocks:
            # The adapter is every block's extra key: KV computed under one LoRA adapter is never another's
            # (nor the base model's, whose extra is empty); so is each image in the blocks it lies in.
            extra = adapter_extra(seq.lora_name)
            known = block_hashes(seq.token_ids, self.block_size, num_full_blocks, extra, known, seq.images)
            self._seq_hashes[seq.seq_id] = known
        return known[:num_full_blocks]

    def _cached_blocks_for(self, seq: Sequence, num_cached_tokens: int) -> list[tuple[bytes, int | None]]:
        """The blocks behind the scheduler's claim that num_cached_tokens of seq are cached."""
        if num_cached_tokens == 0:
            return []
        if not self.enable_prefix_caching or seq.block_table or num_cached_tokens % self.block_size:
            raise ValueError(
                f"num_cached_tokens={num_cached_tokens} needs prefix caching on, a sequence holding no "
                f"blocks, and a multiple of block_size ({self.block_size})"
            )
        blocks = self._matched_blocks(seq)[: num_cached_tokens // self.block_size]
        if len(blocks) * self.block_size != num_cached_tokens:
            raise ValueError(f"only {len(blocks) * self.block_size} tokens of seq {seq.seq_id} are cached")
        return blocks

    def register_full_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Makes seq's full, computed blocks reusable by later requests.

        Call after a step's results are applied (num_computed_tokens advanced by the step, so the KV of
        those tokens is written) and before seq's blocks are freed. Only blocks whose block_size tokens all
        lie below num_computed_tokens (default: seq.num_computed_tokens) are registered: their tokens and
        KV never change again. A block whose prefix another block already caches (two requests computed
        it at once) stays unregistered and is freed as plain memory."""
        if not self.enable_prefix_caching:
            return
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_computed_tokens
        num_full = min(num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._seq_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(start, num_full):
            block, h = seq.block_table[i], hashes[i]
            if self._block_hash[block] is None and h not in self._cached:
                self._block_hash[block] = h
                self._cached[h] = block
                self.events.stored(h)
        self._seq_registered[seq.seq_id] = num_full

    # ---- allocation ----

    def can_allocate(
        self, seq: Sequence, num_tokens: int, reserve: int = 0, num_cached_tokens: int = 0
    ) -> bool:
        """Whether seq can get slots for its first num_tokens tokens and still leave reserve blocks free.

        num_cached_tokens: at admission, the leading tokens to be taken from the prefix cache
        (match_prefix's answer); those blocks cost nothing new, but a cached block that nobody holds
        stops counting as free once it is reused."""
        reused = [b for _, b in self._cached_blocks_for(seq, num_cached_tokens) if b is not None]
        return self._fits(seq, num_tokens, reserve, reused)

    def _fits(self, seq: Sequence, num_tokens: int, reserve: int, cached: list[int]) -> bool:
        """cached: device blocks seq reuses (blocks restored from the host tier need fresh ones)."""
        taken_from_free = sum(1 for b in cached if self._ref_count[b] == 0)
        fresh = self.blocks_needed(seq, num_tokens) - len(cached)
        return fresh + reserve <= self.num_free_blocks - taken_from_free

    def allocate(
        self, seq: Sequence, num_tokens: int, num_cached_tokens: int = 0, count_query: bool = True
    ) -> bool:
        """Gives seq slots for its first num_tokens tokens; all or nothing.

        num_cached_tokens (admission only, see can_allocate): seq's block table starts with the cached
        blocks of that prefix, and the scheduler sets seq.num_computed_tokens to it. count_query: this
        admission counts in the prefix-cache metrics (a client request's first; not a sequence coming
        back after a preemption or a swap, which would count the same prompt again)."""
        matched = self._cached_blocks_for(seq, num_cached_tokens)
        reused = [b for _, b in matched if b is not None]
        if not self._fits(seq, num_tokens, 0, reused):
            return False
        if self.enable_prefix_caching and not seq.block_table:
            if count_query:
                self._count_query(seq.num_tokens, len(reused), len(matched) - len(reused))
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
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_fresh_block())
        return True

    def _count_query(self, num_tokens: int, device_blocks: int, host_blocks: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += device_blocks * self.block_size
        if self.host_tier is not None:
            self.host_cache_queries += num_tokens - device_blocks * self.block_size
            self.host_cache_hits += host_blocks * self.block_size

    def share(self, seq: Sequence, source: Sequence, num_tokens: int) -> int:
        """Gives seq (holding no blocks, with the same leading tokens) source's blocks of its first
        num_tokens tokens, which source has computed (scheduler/forks.py): their reference counts go up.
        Whole blocks only, so they never change again. Returns the tokens they hold."""
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id} already holds blocks")
        num_blocks = min(num_tokens, source.num_computed_tokens) // self.block_size
        shared = source.block_table[:num_blocks]
        for block in shared:
            self._ref_count[block] += 1
        seq.block_table = list(shared)
        return len(shared) * self.block_size

    def _take_fresh_block(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._block_hash[block]
            del self._cached[h]
            self.events.removed(h)
            self._block_hash[block] = None
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
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            if self._ref_count[block] != 1 or self._block_hash[block] is not None:
                raise RuntimeError(f"block {block} past seq {seq.seq_id}'s tokens is shared or cached")
            self._ref_count[block] = 0
            heapq.heappush(self._free, block)
        return dropped

    def free(self, seq: Sequence) -> None:
        """Releases seq's hold on its blocks (finish, abort or preemption). Cached blocks that nobody holds
        any more stay reusable until evicted; the sequence's tail goes first in eviction order. While a
        step in flight computes for seq, its blocks are released only once that step returned."""
        table, seq.block_table = seq.block_table, []
        self._seq_hashes.pop(seq.seq_id, None)
        self._seq_registered.pop(seq.seq_id, None)
        step = self._in_flight.get(seq.seq_id)
        if step is not None:
            self._deferred.append((step, table))
            return
        self._drop(table)

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
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"block {b} is cached under another hash"
        hashed = sum(h is not None for h in self._block_hash)
        assert hashed == len(self._cached), "a hashed block is not cached"
        if tables is not None:
            counts = [0] * self.num_blocks
            for table in [*tables, *(t for _, t in self._deferred)]:
                for b in table:
                    counts[b] += 1
            assert counts == self._ref_count, "reference counts differ from the tables holding the blocks"

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
