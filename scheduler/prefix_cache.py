"""The part of the block manager (scheduler/block_manager.py) that names blocks by their content.

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

from common.block_hash import adapter_extra, block_hashes, matchable_blocks
from common.kv_cache_spec import HOLE
from common.kv_events import KvEvents
from scheduler.sequence import Sequence


class PrefixCache:
    """BlockManager's prefix-cache methods; the state they read and write is set up in its __init__."""

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

    def match_prefix(self, seq: Sequence) -> int:
        """How many leading tokens of seq (which holds no blocks yet) already have their KV cached.

        Full blocks only, and never every token: the last one is always computed so that the step
        yields logits to sample from. Changes nothing."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        n = len(self._matched_blocks(seq))
        while n and self._group_matches(seq, n) is None:
            n -= 1
        return n * self.block_size

    def _group_matches(self, seq: Sequence, n: int) -> list[list[int]] | None:
        """Groups 1..'s leading tables for seq's first n (group 0 cached) blocks: holes before each
        window, the cached blocks inside it; None when one of those is not cached on the device."""
        hashes = self._hashes(seq, n)
        tables = []
        for g, spec in enumerate(self.specs[1:], start=1):
            first = min(spec.first_needed_block(n * self.block_size), n)
            table = [HOLE] * first
            for h in hashes[first:]:
                block = self._group_cached.get((g, h))
                if block is None:
                    return None
                table.append(block)
            tables.append(table)
        return tables

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
        if (
            len(blocks) * self.block_size != num_cached_tokens
            or self._group_matches(seq, len(blocks)) is None
        ):
            raise ValueError(f"only {len(blocks) * self.block_size} tokens of seq {seq.seq_id} are cached")
        return blocks

    def _reused(self, seq: Sequence, num_cached_tokens: int):
        """The cached prefix seq takes at admission: group 0's (hash, device block or None), the other
        groups' leading tables, and every device block among them."""
        matched = self._cached_blocks_for(seq, num_cached_tokens)
        others = self._group_matches(seq, len(matched)) if matched else [[] for _ in self.specs[1:]]
        device = [b for _, b in matched if b is not None] + [b for t in others for b in t if b != HOLE]
        return matched, others, device

    def _register(self, seq: Sequence, num_computed_tokens: int) -> None:
        tables = self.tables(seq)
        num_full = min(num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._seq_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(seq, num_full)
        for g, table in enumerate(tables):
            cache = self._cached if g == 0 else self._group_cached
            for i in range(start, min(num_full, len(table))):
                block, key = table[i], hashes[i] if g == 0 else (g, hashes[i])
                known = key in cache
                if block == HOLE or self._block_hash[block] is not None or not self._take_over(cache, key):
                    continue
                self._block_hash[block] = key
                cache[key] = block
                if g == 0 and not known:  # the routers' index: a replaced copy was never removed
                    self.events.stored(key)
        self._seq_registered[seq.seq_id] = num_full

    def _take_over(self, cache: dict, key) -> bool:
        """Whether a block just computed may be cached under key: yes when no block is, or when the one
        that is is held by nobody (an older copy, evictable, which goes back to the free blocks: the
        copy a sequence holds now is evicted later, so a chain of cached blocks does not keep a hole
        where an old copy was evicted before its neighbours)."""
        old = cache.get(key)
        if old is None:
            return True
        if self._ref_count[old] > 0:
            return False
        del self._evictable[old], cache[key]
        self._block_hash[old] = None
        heapq.heappush(self._free, old)
        return True

    def _count_query(self, num_tokens: int, device_blocks: int, host_blocks: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += device_blocks * self.block_size
        if self.host_tier is not None:
            self.host_cache_queries += num_tokens - device_blocks * self.block_size
            self.host_cache_hits += host_blocks * self.block_size
