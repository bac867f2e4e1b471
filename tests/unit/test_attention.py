"""The paged attention against the gather implementation it replaced (attention_reference.py), on random
steps: decodes, whole prompts, prefill chunks after cached context, short multi-token queries, prefix
blocks shared between sequences, scrambled block ids with unused blocks between them, and one or many
query heads per KV head."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from shard_worker.model.attention import (
    ONE_TOKEN_TILE_CAPACITY,
    PREFILL_MIN_QUERY,
    AttentionMetadata,
    PagedAttention,
    flex_supported,
)
from tests.unit.attention_reference import ReferenceMetadata, ReferencePagedAttention

torch.set_flush_denormal(True)

BLOCK_SIZE = 16


@dataclass
class Step:
    query_lens: list[int]
    context_lens: list[int]
    block_table: torch.Tensor  # [num_seqs, max_blocks], padded with 0
    slot_mapping: torch.Tensor


def random_step(rng: random.Random, num_blocks: int, max_context: int = 300) -> Step:
    """Sequences of every kind, their blocks drawn from a shuffled pool (so ids are scrambled and some
    blocks are in no table); some sequences share their first blocks, as prefix caching does."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    query_lens, context_lens, tables, slots = [], [], [], []
    shared_prefix: list[int] = []
    for _ in range(rng.randint(1, 24)):
        kind = rng.choice(["decode", "decode", "prompt", "chunk", "short"])
        context = rng.randint(1, max_context)
        query = {
            "decode": 1,
            "prompt": context,
            "chunk": rng.randint(1, context),
            "short": rng.randint(1, min(context, PREFILL_MIN_QUERY + 2)),
        }[kind]
        blocks = -(-context // BLOCK_SIZE)
        cached_blocks = (context - query) // BLOCK_SIZE  # whole blocks before the first query
        if shared_prefix and kind in ("chunk", "decode") and rng.random() < 0.5:
            reuse = min(cached_blocks, len(shared_prefix))
            table = shared_prefix[:reuse] + [pool.pop() for _ in range(blocks - reuse)]
        else:
            table = [pool.pop() for _ in range(blocks)]
            if cached_blocks >= 2 and not shared_prefix:
                shared_prefix = table[:cached_blocks]
        query_lens.append(query)
        context_lens.append(context)
        tables.append(table)
        slots += [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context - query, context)
        ]
    width = max(len(t) for t in tables) + rng.randint(0, 3)  # rows padded past the longest table too
    block_table = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = torch.tensor(t)
    return Step(query_lens, context_lens, block_table, torch.tensor(slots))


def run_both(
    step: Step, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, num_blocks: int, seed: int
):
    """(new output, reference output computed in float64 from the same inputs)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(step.query_lens)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    # Random values everywhere, so a key read from the wrong slot or block changes the result.
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    args = (step.query_lens, step.context_lens, step.block_table, step.slot_mapping, BLOCK_SIZE)
    with torch.inference_mode():
        new_md = AttentionMetadata.build(*args, heads // kv_heads)
        new = PagedAttention(heads, kv_heads, head_dim, scale)(
            q.to(dtype), k.to(dtype), v.to(dtype), cache.to(dtype), new_md
        )
        ref_md = ReferenceMetadata.build(*args, heads // kv_heads)
        ref = ReferencePagedAttention(heads, kv_heads, head_dim, scale)(
            q.double(), k.double(), v.double(), cache.double(), ref_md
        )
    return new, ref


TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 64), (4, 2, 32)])
def test_random_steps_match_reference(dtype, heads, kv_heads, head_dim):
    rng = random.Random(f"{dtype}{heads}{kv_heads}")
    num_blocks = 512
    for i in range(6):
        step = random_step(rng, num_blocks)
        new, ref = run_both(step, heads, kv_heads, head_dim, dtype, num_blocks, seed=i)
        assert new.dtype == dtype
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(new.double(), ref, rtol=tol, atol=tol, msg=lambda m, s=step: f"{s}\n{m}")


def test_paths_cover_what_they_claim():
    """float32 on CPU runs the compiled kernel; the dtypes it lacks take the per-sequence path."""
    cpu = torch.device("cpu")
    assert flex_supported(torch.float32, cpu)
    assert not flex_supported(torch.float64, cpu)
    assert not flex_supported(torch.bfloat16, cpu)


def test_short_queries_beyond_the_one_token_capacity():
    """Short queries past the one-token tiles' buffer move to block tiles and still match, next to a
    prompt exactly at the tiling threshold."""
    rng = random.Random(7)
    lens = [(2, rng.randint(2, 40)) for _ in range(ONE_TOKEN_TILE_CAPACITY // 2 + 3)]
    lens.append((PREFILL_MIN_QUERY, PREFILL_MIN_QUERY + 20))
    num_blocks = sum(-(-c // BLOCK_SIZE) for _, c in lens) + 5
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-c // BLOCK_SIZE))] for _, c in lens]
    block_table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = torch.tensor(t)
    slots = [
        t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for (q, c), t in zip(lens, tables, strict=True)
        for p in range(c - q, c)
    ]
    step = Step([q for q, _ in lens], [c for _, c in lens], block_table, torch.tensor(slots))
    new, ref = run_both(step, 4, 2, 16, torch.float32, num_blocks, seed=3)
    torch.testing.assert_close(new.double(), ref, rtol=2e-5, atol=2e-5)


def test_no_recompile_across_step_shapes():
    """After one step of each tiling, steps of other sizes (down to one token, one block, one sequence)
    and another cache size reuse the compiled kernels: a recompile would stall a request for seconds."""
    rng = random.Random(11)
    warm = Step(
        [1, 20],
        [30, 20],
        torch.tensor([[5, 6], [7, 8]]),
        torch.tensor([6 * 16 + 13, *range(7 * 16, 8 * 16 + 4)]),
    )
    run_both(warm, 4, 2, 16, torch.float32, 64, seed=0)
    steps = [
        Step([1], [1], torch.tensor([[3]]), torch.tensor([3 * 16])),  # one token, one block
        Step([9], [9], torch.tensor([[2]]), torch.tensor(range(32, 41))),  # one block tile
    ]
    steps += [random_step(rng, 300) for _ in range(4)]
    with torch.compiler.set_stance("fail_on_recompile"):
        for i, step in enumerate(steps):
            new, ref = run_both(step, 4, 2, 16, torch.float32, 300 + i, seed=i)
            torch.testing.assert_close(new.double(), ref, rtol=2e-5, atol=2e-5)


def test_metadata_does_not_grow_with_the_cache():
    """The block mask of 64 decodes at context 2048 stays small however large the cache: no index
    table of queries x cache blocks is stored, no mask of queries x keys is built."""
    seqs, context = 64, 2048
    blocks = context // BLOCK_SIZE
    table = torch.arange(seqs * blocks).view(seqs, blocks)
    slots = table[:, -1] * BLOCK_SIZE + BLOCK_SIZE - 1
    md = AttentionMetadata.build([1] * seqs, [context] * seqs, table, slots, BLOCK_SIZE, 2)
    for num_cache_blocks in (seqs * blocks, 1_000_000):
        (tiles,) = md.tiles(num_cache_blocks)
        bm = tiles.block_mask
        tensors = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
        stored = sum(t.untyped_storage().nbytes() for t in tensors)
        # The full-block table itself ([tokens, blocks per sequence] int32) dominates.
        assert stored < 2 * (seqs + 1) * (blocks + 1) * 4, stored
