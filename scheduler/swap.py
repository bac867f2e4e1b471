"""The host-memory blocks of every rank (the swap space): preempted sequences' KV, and the prefix cache's
host tier.

Plain Python, like the device pool: every rank holds a host KV cache of num_blocks blocks (--swap-space
GiB), and this decides which host block a device block is copied to. Each host block is free, held by a
swapped-out sequence, or (with the host tier on) caching one full prefix block under its chained hash.

- Swap preemption: a swapped sequence holds host blocks only; its device blocks were released when it
  was swapped out, and it gets fresh ones when it comes back.
- Host tier (cache_prefixes): a cached device block that the device pool evicts is copied here
  (`offload`) instead of being lost, least recently used evicted in turn; a later prompt whose prefix
  continues here gets it copied back into a fresh device block (`restore`) instead of recomputing it.
  The host copy stays (an inclusive tier): evicting that block from the device again costs no copy.

Swapped sequences come first: a cached host block is evicted whenever a swap-out needs its room, since
a preempted sequence is certain to come back and a cached prefix only may be asked for again. That is
why the tier shares --swap-space rather than taking a budget of its own (vLLM's kv_offloading_size):
one host allocation per rank, sized by one flag, and never a preemption recomputed while host memory
holds a prefix nobody may want.

The copies of one step are made by every rank before its forward: all swap-outs (device -> host), then
all swap-ins (device <- host). So within a step a host block is written at most once and never both
written and read: blocks a step's copies read or write are `busy` until the next step begins
(`begin_step`), and a swap-in's released blocks become free only then.

Every block stored in and evicted from the tier goes into `events` (common/kv_events.py): the routers'
index of the replica's host tier.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from common.kv_events import KvEventLog


class HostBlockPool:
    def __init__(self, num_blocks: int, cache_prefixes: bool = False):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must not be negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache_prefixes = cache_prefixes
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}  # seq_id -> its host blocks, in block-table order
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block; first = LRU
        self._block_hash: dict[int, bytes] = {}  # the cached host blocks' hashes
        self._busy: set[int] = set()  # read or written by this step's copies
        self._released: list[int] = []  # swapped in this step: free from the next
        self.events = KvEventLog()
        self.offloaded_blocks = 0  # device blocks copied into the tier since start
        self.restored_blocks = 0  # tier blocks copied back to the device since start

    @property
    def num_free_blocks(self) -> int:
        """Blocks held by no sequence and caching nothing (those a swap-in released included)."""
        return len(self._free) + len(self._released)

    def _available(self) -> int:
        """Blocks a swap-out may take now: free ones, and cached ones no copy of this step uses."""
        return len(self._free) + len(self._cached) - len(self._busy.intersection(self._block_hash))

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[bytes]:
        return list(self._cached)

    def begin_step(self) -> None:
        """The previous step's copies are made: its blocks may be reused."""
        self._free.extend(self._released)
        self._released = []
        self._busy.clear()

    def _take(self) -> int | None:
        """A block to write this step: a free one, else the least recently used cached one no copy of
        this step uses (evicted: its hash leaves the tier). None when there is none."""
        if self._free:
            block = self._free.popleft()
        else:
            h = next((h for h, b in self._cached.items() if b not in self._busy), None)
            if h is None:
                return None
            block = self._cached.pop(h)
            del self._block_hash[block]
            self.events.removed(h)
        self._busy.add(block)
        return block

    # ---- swap preemption ----

    def can_swap_out(self, num_blocks: int) -> bool:
        return 0 < num_blocks <= self._available()

    def swap_out(self, seq_id: int, device_blocks: list[int]) -> list[tuple[int, int]]:
        """Takes a host block for each device block; returns the (device, host) copies to make."""
        if seq_id in self._tables:
            raise KeyError(f"seq {seq_id} is already swapped out")
        if not self.can_swap_out(len(device_blocks)):
            raise ValueError(
                f"{len(device_blocks)} blocks to swap out, {self.num_free_blocks} host blocks free"
            )
        host = [self._take() for _ in device_blocks]
        self._tables[seq_id] = host
        return list(zip(device_blocks, host, strict=True))

    def swap_in(self, seq_id: int, device_blocks: list[int]) -> list[tuple[int, int]]:
        """Releases seq's host blocks (free from the next step on); returns the (host, device) copies into
        its new device blocks."""
        host = self._tables.pop(seq_id)
        self._released.extend(host)
        self._busy.update(host)
        return list(zip(host, device_blocks[: len(host)], strict=True))

    def free(self, seq_id: int) -> None:
        """Drops seq's host copy (abort while swapped)."""
        self._free.extend(self._tables.pop(seq_id, ()))

    # ---- the prefix cache's host tier ----

    def offload(self, h: bytes, device_block: int) -> tuple[int, int] | None:
        """The device pool evicts its cached block device_block (hash h): the (device, host) copy that
        keeps it here, or None when no copy is needed (already here, now the most recent) or possible
        (the tier is off, or every host block is held or in use this step)."""
        if not self.cache_prefixes:
            return None
        if h in self._cached:
            self._cached.move_to_end(h)
            return None
        block = self._take()
        if block is None:
            return None
        self._cached[h] = block
        self._block_hash[block] = h
        self.events.stored(h)
        self.offloaded_blocks += 1
        return device_block, block

    def has(self, h: bytes) -> bool:
        return h in self._cached

    def restore(self, h: bytes) -> int:
        """The host block caching h, kept for this step's copy back to the device (no copy this step
        may overwrite it) and now the most recently used."""
        block = self._cached[h]
        self._cached.move_to_end(h)
        self._busy.add(block)
        self.restored_blocks += 1
        return block

    def check_invariants(self, swapped_seq_ids) -> None:
        """Raises AssertionError unless free + released + held + cached host blocks are all of them, each
        once; exactly the swapped sequences hold some; the cache map and the blocks' hashes agree."""
        held = [b for table in self._tables.values() for b in table]
        everything = list(self._free) + self._released + held + list(self._cached.values())
        assert sorted(everything) == list(range(self.num_blocks)), "host blocks lost or held twice"
        assert set(self._tables) == set(swapped_seq_ids), "host blocks held by a sequence not swapped out"
        assert {b: h for h, b in self._cached.items()} == self._block_hash, "host cache map inconsistent"
        assert self.cache_prefixes or not self._cached, "host blocks cached with the tier off"
