"""A shard worker's swap: KV blocks copied to host memory and back are bit for bit what they were, and a
sequence swapped out and back into other blocks decodes the same tokens as one never swapped."""

from __future__ import annotations

import torch

from shard_worker.step import SequenceInit
from tests.model_families import build_checkpoint
from tests.unit.test_model_runner import (
    BLOCK_SIZE,
    GREEDY,
    NUM_BLOCKS,
    BlockPool,
    Driver,
    Seq,
    new_runner,
    prompt,
    run_step,
)

NUM_HOST_BLOCKS = 8


def test_swap_out_then_in_round_trips_kv_exactly(tiny_model):
    runner = new_runner(tiny_model)
    runner.allocate_host_kv_cache(NUM_HOST_BLOCKS, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen, dtype=cache.dtype))
    before = [c.clone() for c in runner.kv_caches]
    runner.swap_out([5, 2, 9], [3, 0, 7])
    for cache in runner.kv_caches:  # the freed blocks are reused and overwritten
        cache[:, [5, 2, 9]] = float("nan")
    runner.swap_in([0, 3, 7], [11, 1, 40])
    for old, new in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(new[:, [11, 1, 40]], old[:, [2, 5, 9]])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 2, 9, 11, 1, 40)]
        assert torch.equal(new[:, untouched], old[:, untouched])


def test_a_swapped_sequence_decodes_as_if_never_swapped(tiny_model):
    def go(swap: bool) -> list[int]:
        runner = new_runner(tiny_model)
        runner.allocate_host_kv_cache(NUM_HOST_BLOCKS, BLOCK_SIZE)
        pool = BlockPool(NUM_BLOCKS)
        seq = Seq(0, prompt(13, 0), 13)
        driver = Driver(runner)
        driver.add([SequenceInit(0, GREEDY, 0, seq.tokens, seq.prompt_len)])
        run_step(driver, pool, [(seq, seq.prompt_len)])
        run_step(driver, pool, [(seq, 1)])
        if swap:
            old = list(seq.blocks)
            runner.swap_out(old, list(range(len(old))))
            for cache in runner.kv_caches:
                cache[:, old] = float("nan")  # what was there is gone
            seq.blocks = [pool.free.pop() for _ in old]  # fresh blocks, elsewhere
            runner.swap_in(list(range(len(old))), seq.blocks)
        while len(seq.output) < 8:
            run_step(driver, pool, [(seq, 1)])
        return seq.output

    assert go(swap=True) == go(swap=False)


def test_a_swapped_recurrent_state_decodes_as_if_never_swapped(tmp_path):
    """Qwen3-Next: the sequence's KV blocks and its state slot (every linear layer's conv and delta-rule
    state) copied to host memory, the device copies wiped, then copied back: the same tokens."""
    path = build_checkpoint("qwen3_next", tmp_path)

    def go(swap: bool) -> list[int]:
        runner = new_runner(path)
        runner.allocate_host_kv_cache(NUM_HOST_BLOCKS, BLOCK_SIZE)
        runner.allocate_state_cache(4, 2)
        pool = BlockPool(NUM_BLOCKS)
        seq = Seq(3, [t % 256 for t in prompt(21, 0)], 21)  # its state slot: 3 (Driver's: the seq id)
        driver = Driver(runner)
        driver.add([SequenceInit(3, GREEDY, 0, seq.tokens, seq.prompt_len)])
        run_step(driver, pool, [(seq, 9)])  # a chunk, then the rest of the prompt
        run_step(driver, pool, [(seq, 12)])
        if swap:
            old = list(seq.blocks)
            runner.swap_out(old, list(range(len(old))))
            runner.swap_states([3], [1], out=True)
            for cache in runner.kv_caches:
                cache[:, old] = float("nan")
            for conv, delta in runner.state_caches:
                conv[3], delta[3] = float("nan"), float("nan")
            seq.blocks = [pool.free.pop() for _ in old]
            runner.swap_in(list(range(len(old))), seq.blocks)
            runner.swap_states([1], [3], out=False)
        while len(seq.output) < 6:
            run_step(driver, pool, [(seq, 1)])
        return seq.output

    assert go(swap=True) == go(swap=False)
