"""Every attention backend that runs on CPU (flex, reference, and our C++ kernel: cpu) against a naive
float64 attention written here, on random steps: decodes, whole prompts, prefill chunks after cached
context, short multi-token queries, prefix blocks shared between sequences, scrambled block ids with
unused blocks (full of NaN) between them, one or many query heads per KV head, and sliding windows."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from shard_worker.attention import Attention, StepBatch, select_backend
from shard_worker.attention.flex import ONE_TOKEN_TILE_CAPACITY, PREFILL_MIN_QUERY

torch.set_flush_denormal(True)

BLOCK_SIZE = 16
CPU = torch.device("cpu")


@dataclass
class Step:
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]

    def batch(self, width_pad: int = 0) -> StepBatch:
        width = max(len(t) for t in self.tables) + width_pad
        table = np.zeros((len(self.tables), width), dtype=np.int64)
        for row, t in zip(table, self.tables, strict=True):
            row[: len(t)] = t
        q = np.array(self.query_lens, dtype=np.int64)
        c = np.array(self.context_lens, dtype=np.int64)
        ids = np.zeros(int(q.sum()), dtype=np.int64)
        return StepBatch.build(ids, q, c, table, BLOCK_SIZE, CPU)


def random_step(rng: random.Random, num_blocks: int, max_context: int = 300) -> Step:
    """Sequences of every kind, their blocks drawn from a shuffled pool (so ids are scrambled and some
    blocks are in no table); some sequences share their first blocks, as prefix caching does."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    query_lens, context_lens, tables = [], [], []
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
    return Step(query_lens, context_lens, tables)


def naive_attention(step: Step, q, cache, scale: float, window: int | None) -> torch.Tensor:
    """Query by query in float64: its sequence's keys gathered position by position."""
    q, cache = q.double(), cache.double()
    heads, kvh = q.shape[1], cache.shape[3]
    out = torch.zeros_like(q)
    row = 0
    for q_len, c_len, table in zip(step.query_lens, step.context_lens, step.tables, strict=True):
        slots = [table[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(c_len)]
        keys = cache[0].reshape(-1, kvh, cache.shape[-1])[slots]  # [c_len, kvh, d]
        values = cache[1].reshape(-1, kvh, cache.shape[-1])[slots]
        for i in range(q_len):
            p = c_len - q_len + i
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(heads):
                g = h // (heads // kvh)
                scores = keys[lo : p + 1, g] @ q[row, h] * scale
                out[row, h] = torch.softmax(scores, 0) @ values[lo : p + 1, g]
            row += 1
    return out


def run(backend_name: str, step: Step, heads, kv_heads, head_dim, dtype, num_blocks, seed, window=None):
    """(the backend's output, the naive float64 one) for random q/k/v and a cache whose blocks that no
    sequence holds are NaN: a read outside a sequence's table poisons its output."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(step.query_lens)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    cache = torch.full((2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), math.nan)
    used = sorted({b for table in step.tables for b in table})
    cache[:, used] = torch.randn(2, len(used), BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    batch = step.batch(width_pad=2)
    backend = select_backend(backend_name, CPU, dtype)
    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
    with torch.inference_mode():
        mine = cache.to(dtype)
        out = layer(q.to(dtype), k.to(dtype), v.to(dtype), mine, backend.context(batch))
    # The reference reads the keys the backend wrote, so the write is checked too (at the step's slots).
    written = cache.clone()
    slots = batch.slot_mapping
    flat = written.view(2, -1, kv_heads, head_dim)
    flat[0, slots], flat[1, slots] = k, v
    stored = mine.double().view(2, -1, kv_heads, head_dim)[:, slots]
    assert torch.equal(stored, flat[:, slots].to(dtype).double())
    return out, naive_attention(step, q, written, head_dim**-0.5, window)


TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}
CASES = [
    ("flex", torch.float32),
    ("cpu", torch.float32),
    ("reference", torch.float32),
    ("reference", torch.float64),
]
HALF = [("reference", torch.bfloat16), ("cpu", torch.bfloat16), ("cpu", torch.float16)]
TOLERANCE[torch.float16] = 5e-3


SHAPES = [(4, 4, 16), (8, 2, 64), (4, 2, 32)]
# Flex compiles once per head shape (a minute or more on a loaded CPU), so it takes one shape here: GQA
# with 4 query heads per KV head and head_dim 64. Its (4, 2, 16) shape is the sliding-window, short-query
# and recompile tests' below, and its served path tests/unit/test_model_families.py's gemma3-flex case.
RANDOM_STEP_CASES = [
    pytest.param(backend, dtype, *shape, id=f"{'-'.join(map(str, shape))}-{backend}-{dtype}")
    for shape in SHAPES
    for backend, dtype in CASES + HALF
    if backend != "flex" or shape == (8, 2, 64)
]


@pytest.mark.parametrize("backend,dtype,heads,kv_heads,head_dim", RANDOM_STEP_CASES)
def test_random_steps_match_naive_attention(backend, dtype, heads, kv_heads, head_dim):
    rng = random.Random(f"{backend}{dtype}{heads}{kv_heads}")
    for i in range(4):
        step = random_step(rng, 512, max_context=200)
        new, ref = run(backend, step, heads, kv_heads, head_dim, dtype, 512, seed=i)
        assert new.dtype == dtype
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(new.double(), ref, rtol=tol, atol=tol, msg=lambda m, s=step: f"{s}\n{m}")


@pytest.mark.parametrize("backend,dtype", CASES + [("cpu", torch.bfloat16)], ids=str)
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_windows(backend, dtype, window):
    """Windows smaller than a block, of exactly a block and not a multiple of one, over contexts longer
    than the window, with decodes, prompts and chunks in one step."""
    rng = random.Random(f"{backend}{window}")
    for i in range(3):
        step = random_step(rng, 400, max_context=150)
        new, ref = run(backend, step, 4, 2, 16, dtype, 400, seed=i, window=window)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(new.double(), ref, rtol=tol, atol=tol, msg=lambda m, s=step: f"{s}\n{m}")


def test_blocks_before_the_window_are_not_read():
    """NaN in every block a windowed decode does not see: the output stays finite (a read of them,
    even masked, would give NaN)."""
    step = Step([1, 1], [100, 64], [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10]])
    for backend in ("flex", "cpu", "reference"):
        gen = torch.Generator().manual_seed(0)
        cache = torch.randn(2, 12, BLOCK_SIZE, 2, 16, generator=gen)
        cache[:, [0, 1, 2, 7]] = math.nan  # wholly before each sequence's window of 40
        q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
        layer = Attention(4, 2, 16, 0.25, sliding_window=40)
        b = select_backend(backend, CPU, torch.float32)
        with torch.inference_mode():
            out = layer(q, k, v, cache, b.context(step.batch()))
        assert torch.isfinite(out).all(), backend


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
    step = Step([q for q, _ in lens], [c for _, c in lens], tables)
    gen = torch.Generator().manual_seed(3)
    t = sum(step.query_lens)
    q, k, v = (torch.randn(t, h, 16, generator=gen) for h in (4, 2, 2))
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, 2, 16, generator=gen)
    outs = {}
    for name in ("flex", "cpu", "reference"):
        b = select_backend(name, CPU, torch.float32)
        with torch.inference_mode():
            outs[name] = Attention(4, 2, 16, 0.25)(q, k, v, cache.clone(), b.context(step.batch()))
    torch.testing.assert_close(outs["flex"], outs["reference"], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(outs["cpu"], outs["reference"], rtol=2e-5, atol=2e-5)


def test_no_recompile_across_step_shapes():
    """After one step of each tiling, steps of other sizes (down to one token, one block, one sequence),
    another cache size and a windowed layer reuse the compiled kernels: a recompile would stall a request
    for seconds."""
    rng = random.Random(11)
    warm = Step([1, 20], [30, 20], [[5, 6], [7, 8]])
    run("flex", warm, 4, 2, 16, torch.float32, 64, seed=0)
    run("flex", warm, 4, 2, 16, torch.float32, 64, seed=0, window=7)
    steps = [Step([1], [1], [[3]]), Step([9], [9], [[2]])]  # one token, one block; one block tile
    steps += [random_step(rng, 300) for _ in range(4)]
    with torch.compiler.set_stance("fail_on_recompile"):
        for i, step in enumerate(steps):
            for window in (None, 23):
                new, ref = run("flex", step, 4, 2, 16, torch.float32, 300 + i, seed=i, window=window)
                torch.testing.assert_close(new.double(), ref, rtol=2e-5, atol=2e-5)


def test_every_thread_that_steps_gets_the_compiler_settings():
    """torch 2.13 keeps dynamo's settings per thread, and a worker warms up in one gRPC thread and steps in
    another: the settings were made only in the first thread to call flex, so a step thread compiled with
    duck shapes and the default recompile limit (then a silent eager fallback)."""
    import threading

    import torch.fx.experimental._config as fx_config

    from shard_worker.attention.flex import RECOMPILE_LIMIT

    seen = []

    def step():
        run("flex", Step([1, 20], [30, 20], [[5, 6], [7, 8]]), 4, 2, 16, torch.float32, 64, seed=0)
        seen.append((torch._dynamo.config.recompile_limit, fx_config.use_duck_shape))

    for _ in range(2):  # the warm-up's thread, then a step's
        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
    assert seen == [(RECOMPILE_LIMIT, False)] * 2


def test_flex_metadata_does_not_grow_with_the_cache():
    """The block mask of 64 decodes at context 2048 stays small however large the cache: no index
    table of queries x cache blocks is stored, no mask of queries x keys is built."""
    from shard_worker.attention.flex import _Tiling

    seqs, context = 64, 2048
    blocks = context // BLOCK_SIZE
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(seqs)]
    step = Step([1] * seqs, [context] * seqs, tables)
    backend = select_backend("flex", CPU, torch.float32)
    md = backend.prepare(step.batch())
    for num_cache_blocks in (seqs * blocks, 1_000_000):
        (tiles,) = _Tiling(md, 2, num_cache_blocks, None).build()
        bm = tiles.block_mask
        tensors = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
        stored = sum(t.untyped_storage().nbytes() for t in tensors)
        # The full-block table itself ([tokens, blocks per sequence] int32) dominates.
        assert stored < 2 * (seqs + 1) * (blocks + 1) * 4, stored


def test_step_batch_positions_and_slots():
    """Positions count on from each sequence's cached tokens; each slot is its position's block in the
    sequence's table times block_size plus the offset (written out here independently)."""
    step = Step([3, 1, 17], [3, 40, 20], [[9], [4, 2, 7], [1, 5]])
    batch = step.batch(width_pad=1)
    assert batch.positions.tolist() == [0, 1, 2, 39, *range(3, 20)]
    expected = [9 * 16 + 0, 9 * 16 + 1, 9 * 16 + 2, 7 * 16 + 7] + [1 * 16 + p for p in range(3, 16)]
    expected += [5 * 16 + p - 16 for p in range(16, 20)]
    assert batch.slot_mapping.tolist() == expected
    assert batch.query_start_loc.tolist() == [0, 3, 4, 21]
    assert batch.seq_lens.tolist() == [3, 40, 20]


@pytest.mark.parametrize(
    "q,c,width,message",
    [([0], [5], 1, "query_len 0"), ([6], [5], 1, "query_len 6"), ([1], [40], 2, "more blocks")],
)
def test_step_batch_refuses_bad_steps(q, c, width, message):
    with pytest.raises(ValueError, match=message):
        StepBatch.build(
            np.zeros(sum(q), dtype=np.int64),
            np.array(q),
            np.array(c),
            np.zeros((1, width), dtype=np.int64),
            BLOCK_SIZE,
            CPU,
        )


def test_backend_choice():
    # This machine has a C++ compiler (inductor needs one too): the kernel builds and auto takes it.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert select_backend("auto", CPU, dtype).name == "cpu"
    assert select_backend("auto", CPU, torch.float64).name == "reference"
    with pytest.raises(ValueError, match="--attention-backend cpu: the CPU kernel runs on CPU in float32"):
        select_backend("cpu", CPU, torch.float64)
    with pytest.raises(ValueError, match="--attention-backend flex: flex attention runs on CPU in float32"):
        select_backend("flex", CPU, torch.float64)
