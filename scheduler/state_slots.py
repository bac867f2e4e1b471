"""Which recurrent-state slot each sequence holds (common/kv_cache_spec.py RecurrentStateSpec), on the
device and in the host swap space. Plain Python, like the block pool it sits beside (BlockManager owns
one and takes and frees slots in its allocate and free, the one release path).

A sequence takes a device slot when it is first given blocks and keeps it until it finishes, is aborted
or is preempted; release() hands the slot back exactly once (a second call finds nothing). A swap-out
copies the device slot to a host slot and lets the device slot go; a swap-in takes a device slot and
copies the host slot back. As with host blocks (scheduler/swap.py), a host slot a swap-in reads this step
is free only from the next one, since the workers make every step's swap-outs before its swap-ins.
"""

from __future__ import annotations

import heapq


class StateSlots:
    def __init__(self, num_slots: int, num_host_slots: int = 0):
        if num_slots <= 0 or num_host_slots < 0:
            raise ValueError(
                f"num_slots ({num_slots}) must be positive, num_host_slots ({num_host_slots}) not negative"
            )
        self.num_slots = num_slots
        self.num_host_slots = num_host_slots
        self._free = list(range(num_slots))  # a min-heap, like the blocks
        self._held: dict[int, int] = {}  # seq_id -> device slot
        self._host_free = list(range(num_host_slots))
        self._host_held: dict[int, int] = {}  # seq_id -> host slot (swapped out)
        self._host_released: list[int] = []  # read by this step's swap-ins: free from the next

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, seq_id: int) -> int | None:
        return self._held.get(seq_id)

    def take(self, seq_id: int) -> int:
        """seq's device slot: the one it holds, or a free one."""
        if seq_id in self._held:
            return self._held[seq_id]
        if not self._free:
            raise ValueError(f"no state slot free for seq {seq_id}: check num_free first")
        self._held[seq_id] = slot = heapq.heappop(self._free)
        return slot

    def release(self, seq_id: int) -> int | None:
        """seq no longer holds its device slot: the slot (for put_back, now or once the step in flight
        that writes it returned), or None when it held none."""
        return self._held.pop(seq_id, None)

    def put_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    # ---- swap ----

    def can_swap_out(self) -> bool:
        return bool(self._host_free)

    def swap_out(self, seq_id: int) -> tuple[int, int]:
        """(device slot, host slot) to copy; seq then holds the host slot (its device slot is freed with
        its blocks, by release)."""
        device = self._held[seq_id]
        self._host_held[seq_id] = host = self._host_free.pop()
        return device, host

    def swap_in(self, seq_id: int) -> tuple[int, int]:
        """(host slot, device slot) to copy back, into the device slot seq holds (take() first)."""
        host = self._host_held.pop(seq_id)
        self._host_released.append(host)
        return host, self._held[seq_id]

    def drop_host(self, seq_id: int) -> None:
        """seq's host copy is not needed (aborted while swapped, or recomputed)."""
        host = self._host_held.pop(seq_id, None)
        if host is not None:
            self._host_free.append(host)

    def begin_step(self) -> None:
        self._host_free += self._host_released
        self._host_released = []

    def check_invariants(self, holders=None, deferred=()) -> None:
        """Every device slot is free, held or waiting for a step in flight (deferred), once; every host
        slot free, held or released this step, once; given the sequences that should hold device slots,
        exactly they do."""
        device = list(self._free) + list(self._held.values()) + list(deferred)
        assert sorted(device) == list(range(self.num_slots)), "state slots lost or held twice"
        host = self._host_free + list(self._host_held.values()) + self._host_released
        assert sorted(host) == list(range(self.num_host_slots)), "host state slots lost or held twice"
        if holders is not None:
            assert set(self._held) == set(holders), "state slots held by sequences not running"
