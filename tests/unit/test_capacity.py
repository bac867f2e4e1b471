"""The capacity the ranks agree on (scheduler/capacity.py), as plain Python."""

import pytest

from scheduler.capacity import CapacityError, RankCapacity, settle


def ranks(*blocks, block_bytes=1 << 20, positions=4096):
    return [RankCapacity(r, n, block_bytes, positions) for r, n in enumerate(blocks)]


def test_the_pool_is_the_smallest_rank_within_the_tolerance():
    cap = settle(ranks(1000, 960, 1000), block_size=16, max_num_seqs=128)
    assert cap.num_blocks == 960 and cap.max_model_len == 4096 and cap.num_host_blocks == 0


def test_ranks_that_disagree_beyond_the_tolerance_are_refused_with_the_figures():
    with pytest.raises(CapacityError, match=r"\[1000, 500\]"):
        settle(ranks(1000, 500), block_size=16, max_num_seqs=128)
    settle(ranks(1000, 500), block_size=16, max_num_seqs=128, tolerance=0.6)  # an explicit wider band


def test_max_model_len_is_capped_by_the_model_and_by_the_pool():
    cap = settle(ranks(10_000), block_size=16, max_num_seqs=8, max_model_len=9000)
    assert cap.max_model_len == 4096 and any("beyond the model" in n for n in cap.notes)
    small = settle(ranks(100), block_size=16, max_num_seqs=8)
    assert small.max_model_len == 1600 and any("capped" in n for n in small.notes)


def test_the_pool_is_capped_at_max_num_seqs_full_length_sequences():
    cap = settle(ranks(1_000_000), block_size=16, max_num_seqs=4, max_model_len=1024)
    assert cap.num_blocks == 4 * 64


def test_swap_space_counts_the_largest_block_over_ranks():
    two = [RankCapacity(0, 100, 1 << 20, 4096), RankCapacity(1, 100, 2 << 20, 4096)]
    assert settle(two, block_size=16, max_num_seqs=8, swap_space_gib=1.0).num_host_blocks == 512


def test_no_blocks_at_all_is_an_error():
    with pytest.raises(CapacityError):
        settle(ranks(0, 0), block_size=16, max_num_seqs=8)
