"""Each sequence's KV block table, kept on the worker between steps.

The scheduler owns the block tables (scheduler/block_manager.py); a worker keeps a copy of the ones it
has been told about and applies each step's changes (StepRequest.table_reset, new_block_counts,
new_block_ids), so a step carries the few blocks sequences gained rather than every table. Tables live
in one int64 array, a row per sequence, so a step's batch table is one fancy-indexed copy. Which row is
whose is the sequence's to know (shard_worker/worker.py WorkerSequence.row): rows are taken and given
back, nothing here is keyed by sequence.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64):
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be at least 1, got {max_blocks_per_seq}")
        self.max_blocks_per_seq = max_blocks_per_seq
        self._table = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int64)
        self._len = np.zeros(initial_rows, dtype=np.int64)
        self._free_rows = list(range(initial_rows - 1, -1, -1))
        self.rows_in_use = 0

    def take_row(self) -> int:
        """An empty row for a new sequence."""
        if not self._free_rows:
            self._grow()
        self.rows_in_use += 1
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        """The row's sequence is gone: the row is cleared and may be handed out again."""
        self._table[row, : self._len[row]] = 0
        self._len[row] = 0
        self._free_rows.append(row)
        self.rows_in_use -= 1

    def table(self, row: int) -> list[int]:
        return self._table[row, : self._len[row]].tolist()

    def apply(
        self,
        rows: np.ndarray,
        table_reset: np.ndarray,
        new_block_counts: np.ndarray,
        new_block_ids: np.ndarray,
    ) -> np.ndarray:
        """Applies one step's changes to the batch's rows (in batch order); returns the batch's tables,
        [num_seqs, longest table], each row padded with 0 past its sequence's blocks."""
        if not len(rows) == len(table_reset) == len(new_block_counts):
            raise ValueError(
                f"{len(rows)} sequences, {len(table_reset)} resets, {len(new_block_counts)} block counts"
            )
        if int(new_block_counts.sum()) != len(new_block_ids):
            raise ValueError(
                f"block counts sum to {int(new_block_counts.sum())}, {len(new_block_ids)} ids given"
            )
        starts = np.cumsum(new_block_counts) - new_block_counts
        # Most sequences of a decode step gain nothing: touch only those that changed.
        for i in np.flatnonzero(table_reset | new_block_counts):
            row, n = rows[i], int(new_block_counts[i])
            at = 0 if table_reset[i] else int(self._len[row])
            if at + n > self.max_blocks_per_seq:
                raise ValueError(
                    f"batch row {i}: {at + n} blocks, more than max_model_len allows "
                    f"({self.max_blocks_per_seq})"
                )
            self._table[row, at + n : self._len[row]] = 0  # a reset to a shorter table
            self._table[row, at : at + n] = new_block_ids[starts[i] : starts[i] + n]
            self._len[row] = at + n
        width = int(self._len[rows].max()) if len(rows) else 0
        return self._table[rows, :width]

    def _grow(self) -> None:
        old = len(self._len)
        self._table = np.concatenate([self._table, np.zeros_like(self._table)])
        self._len = np.concatenate([self._len, np.zeros_like(self._len)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))
