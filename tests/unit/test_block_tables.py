"""The worker's copy of the block tables (shard_worker/block_tables.py), driven by step deltas."""

import numpy as np
import pytest

from shard_worker.block_tables import BlockTables

BLOCK = 4  # tokens a block holds, in these tests


def step(tables, seqs, resets, counts, ids, rows, contexts=None):
    """One step's deltas for these sequences; rows: seq id -> its row, taken on first sight (as the
    worker does when a sequence is introduced). contexts: each one's tokens after the step (default: one
    token in its last block, which any table of its blocks covers)."""
    a = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    for s in seqs:
        if s not in rows:
            rows[s] = tables.take_row()
    if contexts is None:
        contexts = [1] * len(seqs)
    return tables.apply(a(seqs), a([rows[s] for s in seqs]), a(resets), a(counts), a(ids), a(contexts))


def test_tables_grow_from_deltas_and_reset_when_told():
    t, rows = BlockTables(max_blocks_per_seq=8, num_blocks=16, block_size=BLOCK), {}
    batch = step(t, [7, 9], [1, 1], [2, 1], [4, 5, 6], rows)
    assert batch.tolist() == [[4, 5], [6, 0]]
    batch = step(t, [7, 9], [0, 0], [0, 1], [3], rows)  # 9 gained block 3; 7 nothing
    assert batch.tolist() == [[4, 5], [6, 3]]
    batch = step(t, [9], [1], [1], [8], rows)  # 9 back after a preemption: a fresh, shorter table
    assert batch.tolist() == [[8]] and t.table(rows[9]) == [8]
    assert t.table(rows[7]) == [4, 5]


def test_released_rows_are_reused_clean_and_the_array_grows():
    t, rows = BlockTables(max_blocks_per_seq=4, num_blocks=16, block_size=BLOCK, initial_rows=2), {}
    step(t, [1, 2], [1, 1], [3, 3], [1, 2, 3, 4, 5, 6], rows)
    t.release(rows.pop(1))
    assert t.rows_in_use == 1
    assert step(t, [3], [1], [1], [9], rows).tolist() == [[9]]  # row 1's old blocks are gone
    step(t, [4, 5], [1, 1], [1, 1], [10, 11], rows)  # past the initial rows
    assert t.table(rows[2]) == [4, 5, 6] and t.table(rows[5]) == [11]


def test_bad_deltas_are_refused():
    t = BlockTables(max_blocks_per_seq=2, num_blocks=16, block_size=BLOCK)
    with pytest.raises(ValueError, match="sequence 1: 3 blocks, more than max_model_len"):
        step(t, [1], [1], [3], [1, 2, 3], {})
    with pytest.raises(ValueError, match="sum"):
        step(t, [1], [1], [2], [1], {})


@pytest.mark.parametrize("bad", [16, 99, -1])
def test_a_block_id_outside_the_pool_is_refused_naming_the_sequence_and_the_id(bad):
    t, rows = BlockTables(max_blocks_per_seq=4, num_blocks=16, block_size=BLOCK), {}
    step(t, [5, 6], [1, 1], [1, 1], [1, 2], rows)
    with pytest.raises(ValueError, match=f"sequence 6: block id {bad} is outside the KV cache's 16 blocks"):
        step(t, [5, 6], [0, 0], [1, 2], [3, 4, bad], rows)
    # Nothing of the refused step was applied: 5 did not gain block 3.
    assert t.table(rows[5]) == [1] and t.table(rows[6]) == [2]


def test_a_table_shorter_than_its_context_is_refused_rather_than_padded_with_block_0():
    t, rows = BlockTables(max_blocks_per_seq=4, num_blocks=16, block_size=BLOCK), {}
    step(t, [5], [1], [2], [7, 8], rows, contexts=[8])  # 8 tokens: two blocks of 4, exactly
    with pytest.raises(
        ValueError, match="sequence 5: a context of 9 tokens needs 3 blocks, its table holds 2"
    ):
        step(t, [5], [0], [0], [], rows, contexts=[9])
    with pytest.raises(
        ValueError, match="sequence 9: a context of 5 tokens needs 2 blocks, its table holds 1"
    ):
        step(t, [5, 9], [0, 1], [1, 1], [3, 4], rows, contexts=[9, 5])
    assert step(t, [5], [0], [1], [3], rows, contexts=[9]).tolist() == [[7, 8, 3]]
