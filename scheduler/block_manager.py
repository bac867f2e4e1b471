"""The pool of KV-cache blocks and which sequence holds which.

Plain Python: the workers hold the tensors; this decides which block a token's key and value go to.
"""

from __future__ import annotations

from collections import deque

from scheduler.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse: a block freed long ago is handed out before one freed just now.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so that its first num_tokens tokens have a slot."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_tokens) + reserve <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives seq slots for its first num_tokens tokens; all or nothing."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            return False
        seq.block_table.extend(self._free.popleft() for _ in range(needed))
        return True

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
