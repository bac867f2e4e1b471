"""Each sequence's KV block table, kept on the worker between steps.

The scheduler owns the block tables (scheduler/block_manager.py); a worker keeps a copy of the ones it
has been told about and applies each step's changes (StepRequest.table_reset, new_block_counts,
new_block_ids), so a step carries the few blocks sequences gained rather than every table. Tables live
in one int64 array, a row per sequence, so a step's batch table is one fancy-indexed copy.
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
        self._row: dict[int, int] = {}  # seq id -> its row
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row

    def table(self, seq_id: int) -> list[int]:
        row = self._row[seq_id]
        return self._table[row, : self._len[row]].tolist()

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            row = self._row.pop(int(seq_id), None)
            if row is not None:
                self._table[row, : self._len[row]] = 0
                self._len[row] = 0
                self._free_rows.append(row)

    def apply(
        self,
        seq_ids: np.ndarray,
        table_reset: np.ndarray,
        new_block_counts: np.ndarray,
        new_block_ids: np.ndarray,
    ) -> np.ndarray:
        """Applies one step's changes; returns the batch's tables, [num_seqs, longest table], each row
        padded with 0 past its sequence's blocks."""
        if not len(seq_ids) == len(table_reset) == len(new_block_counts):
            raise ValueError(
                f"{len(seq_ids)} sequences, {len(table_reset)} resets, {len(new_block_counts)} block counts"
            )
        if int(new_block_counts.sum()) != len(new_block_ids):
            raise ValueError(
                f"block counts sum to {int(new_block_counts.sum())}, {len(new_block_ids)} ids given"
            )
        rows = np.fromiter((self._row_of(int(s)) for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        starts = np.cumsum(new_block_counts) - new_block_counts
        # Most sequences of a decode step gain nothing: touch only those that changed.
        for i in np.flatnonzero(table_reset | new_block_counts):
            row, n = rows[i], int(new_block_counts[i])
            at = 0 if table_reset[i] else int(self._len[row])
            if at + n > self.max_blocks_per_seq:
                raise ValueError(
                    f"sequence {int(seq_ids[i])}: {at + n} blocks, more than max_model_len allows "
                    f"({self.max_blocks_per_seq})"
                )
            self._table[row, at + n : self._len[row]] = 0  # a reset to a shorter table
            self._table[row, at : at + n] = new_block_ids[starts[i] : starts[i] + n]
            self._len[row] = at + n
        width = int(self._len[rows].max()) if len(rows) else 0
        return self._table[rows, :width]

    def _row_of(self, seq_id: int) -> int:
        row = self._row.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self._row[seq_id] = self._free_rows.pop()
            self._len[row] = 0
        return row

    def _grow(self) -> None:
        old = len(self._len)
        self._table = np.concatenate([self._table, np.zeros_like(self._table)])
        self._len = np.concatenate([self._len, np.zeros_like(self._len)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))
