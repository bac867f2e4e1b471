"""The host-memory blocks that preempted sequences' KV is swapped to (swap preemption).

Plain Python, like the device pool: every rank holds a host KV cache of num_blocks blocks, and this
decides which host block a swapped-out device block is copied to. A swapped sequence holds host blocks
only; its device blocks were released when it was swapped out, and it gets fresh ones when it comes back.
"""

from __future__ import annotations

from collections import deque


class HostBlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must not be negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}  # seq_id -> its host blocks, in block-table order

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_swap_out(self, num_blocks: int) -> bool:
        return 0 < num_blocks <= len(self._free)

    def swap_out(self, seq_id: int, device_blocks: list[int]) -> list[tuple[int, int]]:
        """Takes a host block for each device block; returns the (device, host) copies to make."""
        if seq_id in self._tables:
            raise KeyError(f"seq {seq_id} is already swapped out")
        if not self.can_swap_out(len(device_blocks)):
            raise ValueError(f"{len(device_blocks)} blocks to swap out, {len(self._free)} host blocks free")
        host = [self._free.popleft() for _ in device_blocks]
        self._tables[seq_id] = host
        return list(zip(device_blocks, host, strict=True))

    def swap_in(self, seq_id: int, device_blocks: list[int]) -> list[tuple[int, int]]:
        """Releases seq's host blocks; returns the (host, device) copies into its new device blocks.

        The host blocks are free again once this step's copies are made: the scheduler never puts a
        swap-out into the step that swaps in, so nothing overwrites them before they are read."""
        host = self._tables.pop(seq_id)
        self._free.extend(host)
        return list(zip(host, device_blocks[: len(host)], strict=True))

    def check_invariants(self, swapped_seq_ids) -> None:
        """Raises AssertionError unless free + held host blocks are all of them, each once, and exactly
        the swapped sequences hold some."""
        held = [b for table in self._tables.values() for b in table]
        everything = list(self._free) + held
        assert sorted(everything) == list(range(self.num_blocks)), "host blocks lost or held twice"
        assert set(self._tables) == set(swapped_seq_ids), "host blocks held by a sequence not swapped out"

    def free(self, seq_id: int) -> None:
        """Drops seq's host copy (abort while swapped)."""
        self._free.extend(self._tables.pop(seq_id, ()))
