"""What one replica's prefix cache holds, as the router knows it from the replica's KV events.

The scheduler sends its cache's net change once per step and a snapshot when the stream starts or its
cache was replaced (common/kv_events.py); applying them in order keeps this index equal to the
replica's set of cached block hashes, one step behind. A request's prompt is hashed the same way
(common/block_hash.py), so the tokens a replica would not recompute are the leading hashes found here.

Memory is bounded: past `capacity` hashes the oldest-stored are dropped (and counted in `dropped`), so a
router in front of replicas with more cache than it budgets for routes on part of what they hold rather
than growing without end. The oldest first since a replica evicts its least recently used blocks first
too. Plain Python, no gRPC.

Two tiers: a hash the replica holds on its device, in its host tier (host memory, copied back before
use rather than recomputed), or both; `match` walks a prompt's blocks while either tier has them and
says how many each served (the device first, as the replica's scheduler would).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.kv_events import KvEvents

DEVICE, HOST = 1, 2  # the tiers holding a hash, as bits


class CacheIndex:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._hashes: dict[bytes, int] = {}  # hash -> its tiers; in the order stored: the first dropped first
        self.dropped = 0  # hashes forgotten for lack of room while the replica still held them

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, h: bytes) -> bool:
        return h in self._hashes

    def hashes(self, tier: int = DEVICE) -> set[bytes]:
        """The hashes held in this tier."""
        return {h for h, tiers in self._hashes.items() if tiers & tier}

    def apply(self, events: KvEvents) -> None:
        """One batch of the replica's events, in the order they came."""
        if events.reset:
            self._hashes.clear()
        for tier, removed in ((DEVICE, events.removed), (HOST, events.host_removed)):
            for h in removed:
                tiers = self._hashes.get(h, 0) & ~tier
                if tiers:
                    self._hashes[h] = tiers
                else:
                    self._hashes.pop(h, None)
        for tier, stored in ((DEVICE, events.stored), (HOST, events.host_stored)):
            for h in stored:
                self._hashes[h] = self._hashes.get(h, 0) | tier
        while len(self._hashes) > self.capacity:
            del self._hashes[next(iter(self._hashes))]
            self.dropped += 1

    def clear(self) -> None:
        """The replica is lost: whatever it held may be gone; its next stream starts with a snapshot."""
        self._hashes.clear()

    def match(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """Of the leading blocks of a prompt (their chained hashes, in order) the replica holds in either
        tier: how many on its device, and how many only in its host tier."""
        device = host = 0
        for h in hashes:
            tiers = self._hashes.get(h, 0)
            if tiers & DEVICE:
                device += 1
            elif tiers:
                host += 1
            else:
                break
        return device, host

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt the replica holds, in either tier."""
        return sum(self.match(hashes))
