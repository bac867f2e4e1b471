"""The worker's copy of the block tables (shard_worker/block_tables.py), driven by step deltas."""

import numpy as np
import pytest

from shard_worker.block_tables import BlockTables


def step(tables, seqs, resets, counts, ids, rows):
    """One step's deltas for these sequences; rows: seq id -> its row, taken on first sight (as the
    worker does when a sequence is introduced)."""
    a = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    for s in seqs:
        if s not in rows:
            rows[s] = tables.take_row()
    return tables.apply(a([rows[s] for s in seqs]), a(resets), a(counts), a(ids))


def test_tables_grow_from_deltas_and_reset_when_told():
    t, rows = BlockTables(max_blocks_per_seq=8), {}
    batch = step(t, [7, 9], [1, 1], [2, 1], [4, 5, 6], rows)
    assert batch.tolist() == [[4, 5], [6, 0]]
    batch = step(t, [7, 9], [0, 0], [0, 1], [3], rows)  # 9 gained block 3; 7 nothing
    assert batch.tolist() == [[4, 5], [6, 3]]
    batch = step(t, [9], [1], [1], [8], rows)  # 9 back after a preemption: a fresh, shorter table
    assert batch.tolist() == [[8]] and t.table(rows[9]) == [8]
    assert t.table(rows[7]) == [4, 5]


def test_released_rows_are_reused_clean_and_the_array_grows():
    t, rows = BlockTables(max_blocks_per_seq=4, initial_rows=2), {}
    step(t, [1, 2], [1, 1], [3, 3], [1, 2, 3, 4, 5, 6], rows)
    t.release(rows.pop(1))
    assert t.rows_in_use == 1
    assert step(t, [3], [1], [1], [9], rows).tolist() == [[9]]  # row 1's old blocks are gone
    step(t, [4, 5], [1, 1], [1, 1], [10, 11], rows)  # past the initial rows
    assert t.table(rows[2]) == [4, 5, 6] and t.table(rows[5]) == [11]


def test_bad_deltas_are_refused():
    t = BlockTables(max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="max_model_len"):
        step(t, [1], [1], [3], [1, 2, 3], {})
    with pytest.raises(ValueError, match="sum"):
        step(t, [1], [1], [2], [1], {})
