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
    def __init__(self, max_blocks_per_seq: int, num_blocks: int, block_size: int, initial_rows: int = 64):
        """num_blocks: the KV cache's blocks (ids 0 .. num_blocks - 1); block_size: tokens a block holds.
        Every id a step writes is checked against the pool, and every sequence's table against its
        context, here on the host: the kernels then read only blocks of the pool, each sequence its own."""
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be at least 1, got {max_blocks_per_seq}")
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_blocks = num_blocks
        self.block_size = block_size
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
        seq_ids: np.ndarray,
        rows: np.ndarray,
        table_reset: np.ndarray,
        new_block_counts: np.ndarray,
        new_block_ids: np.ndarray,
        context_lens: np.ndarray,
    ) -> np.ndarray:
        """Applies one step's changes to the batch's rows (in batch order: sequence seq_ids[i] holds row
        rows[i]); returns the batch's tables, [num_seqs, longest table], each row padded with 0 past its
        sequence's blocks. Raises ValueError naming the sequence when an id is outside the pool or a
        table holds fewer blocks than its context_lens needs (nothing is changed by a refused step)."""
        if not len(seq_ids) == len(rows) == len(table_reset) == len(new_block_counts) == len(context_lens):
            raise ValueError(
                f"{len(seq_ids)} sequences, {len(rows)} rows, {len(table_reset)} resets, "
                f"{len(new_block_counts)} block counts, {len(context_lens)} context lengths"
            )
        if int(new_block_counts.sum()) != len(new_block_ids):
            raise ValueError(
                f"block counts sum to {int(new_block_counts.sum())}, {len(new_block_ids)} ids given"
            )
        starts = np.cumsum(new_block_counts) - new_block_counts
        bad = np.flatnonzero((new_block_ids < 0) | (new_block_ids >= self.num_blocks))
        if len(bad):
            owner = int(np.searchsorted(starts + new_block_counts, bad[0], side="right"))
            raise ValueError(
                f"sequence {int(seq_ids[owner])}: block id {int(new_block_ids[bad[0]])} is outside the KV "
                f"cache's {self.num_blocks} blocks"
            )
        lens = np.where(table_reset, 0, self._len[rows]) + new_block_counts
        over = np.flatnonzero(lens > self.max_blocks_per_seq)
        if len(over):
            raise ValueError(
                f"sequence {int(seq_ids[over[0]])}: {int(lens[over[0]])} blocks, more than max_model_len "
                f"allows ({self.max_blocks_per_seq})"
            )
        # A table shorter than its context would have the kernels read the padding (block 0: another
        # sequence's keys and values) for the positions it lacks.
        short = np.flatnonzero(lens * self.block_size < context_lens)
        if len(short):
            i = short[0]
            raise ValueError(
                f"sequence {int(seq_ids[i])}: a context of {int(context_lens[i])} tokens needs "
                f"{-(-int(context_lens[i]) // self.block_size)} blocks, its table holds {int(lens[i])}"
            )
        # Most sequences of a decode step gain nothing: touch only those that changed.
        for i in np.flatnonzero(table_reset | new_block_counts):
            row, n = rows[i], int(new_block_counts[i])
            at = 0 if table_reset[i] else int(self._len[row])
            self._table[row, at + n : self._len[row]] = 0  # a reset to a shorter table
            self._table[row, at : at + n] = new_block_ids[starts[i] : starts[i] + n]
            self._len[row] = at + n
        width = int(lens.max()) if len(rows) else 0
        return self._table[rows, :width]

    def _grow(self) -> None:
        old = len(self._len)
        self._table = np.concatenate([self._table, np.zeros_like(self._table)])
        self._len = np.concatenate([self._len, np.zeros_like(self._len)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))
