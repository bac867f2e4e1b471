"""What a scheduler tells its routers about its prefix cache: the block hashes it stored and removed.

The scheduler's BlockManager records each block it registers in the prefix cache (stored) and each
cached block it evicts (removed) in a `KvEventLog`; once per step the engine takes the log's net change
as one `KvEvents` and sends it on every router's stream with the step's outputs (vLLM's KVEventBatch of
BlockStored / BlockRemoved / AllBlocksCleared, in our own shape). A router that connects, and every
router after the scheduler's cache was replaced (its ranks came back with fresh caches; a restarted
scheduler is a new stream), gets a snapshot instead: `reset` and every hash held. So a router's index of
a replica (router/cache_index.py) equals the replica's cache after each message, one step behind.

The net change is what makes batching exact: a hash stored and removed within one step is in neither
list, one removed and stored again is in neither, and the two lists never share a hash, so applying
them in any order to the previous state gives the new one. Applying a change to a snapshot taken after
some of it happened is harmless too (adding what is there, removing what is not).

Two tiers: the device cache's changes in stored / removed, the host tier's (scheduler/swap.py: blocks
evicted from the device and kept in host memory) in host_stored / host_removed. A hash may be in both
(the host tier keeps its copy when a block goes back to the device); reset covers both.

Plain Python; `fill` / `from_message` are the only code that knows the wire form (KvEvents in
scheduler.proto).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvEvents:
    """One batch of prefix-cache changes of one replica."""

    stored: tuple[bytes, ...] = ()  # hashes now cached on the device that were not
    removed: tuple[bytes, ...] = ()  # hashes no longer cached on the device
    # A snapshot: forget everything held for this replica first (both tiers); stored and host_stored
    # are then all it holds.
    reset: bool = False
    host_stored: tuple[bytes, ...] = ()  # the same for the host tier
    host_removed: tuple[bytes, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.reset or self.host_stored or self.host_removed)

    def fill(self, message) -> None:
        """Writes this batch into a KvEvents message (scheduler.proto)."""
        message.reset = self.reset
        message.stored.extend(self.stored)
        message.removed.extend(self.removed)
        message.host_stored.extend(self.host_stored)
        message.host_removed.extend(self.host_removed)

    @classmethod
    def from_message(cls, message) -> KvEvents:
        return cls(
            tuple(message.stored),
            tuple(message.removed),
            message.reset,
            tuple(message.host_stored),
            tuple(message.host_removed),
        )


class KvEventLog:
    """The net change of a cache's hashes since the last `take`."""

    def __init__(self):
        self._stored: dict[bytes, None] = {}  # insertion-ordered sets
        self._removed: dict[bytes, None] = {}
        # The cache was replaced since the last take (a new pool): routers need a snapshot.
        self.reset = True

    def stored(self, h: bytes) -> None:
        if h in self._removed:
            del self._removed[h]  # removed, then stored again: no change
        else:
            self._stored[h] = None

    def removed(self, h: bytes) -> None:
        if h in self._stored:
            del self._stored[h]  # stored, then removed: no change
        else:
            self._removed[h] = None

    def take(self) -> KvEvents:
        """The change since the last take (reset: a snapshot is due instead), and starts a new one."""
        events = KvEvents(tuple(self._stored), tuple(self._removed), self.reset)
        self._stored, self._removed, self.reset = {}, {}, False
        return events
