"""Cases for tests/unit/test_triton_kernels.py, each a few launches of the Triton paged-attention kernel
under the interpreter, checked against an independent float64 reference written here.

Run as `TRITON_INTERPRET=1 python tests/unit/triton_kernel_cases.py CASE...`: one process per test, so
an out-of-bounds access (which segfaults the interpreter) fails one test, not the run. Prints one JSON
line per check ({"case", "check", "dtype", "max_err", "tol"}) and exits 1 if any check fails.

Every step is built adversarially: each sequence's blocks are a random, unordered subset of the cache
with unused blocks between them; every slot that holds no key (unused blocks, the tail of a sequence's
last block, blocks wholly outside a sliding window) is NaN, so a kernel that lets one into a sum gives
NaN; every block-table entry past a sequence's blocks is an id far past the cache, so a kernel that
follows one faults.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("set TRITON_INTERPRET=1: the kernels run on CPU tensors only under Triton's interpreter")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shard_worker.attention.kernels import paged_attention  # noqa: E402
from tests.unit.interpreted import run_cases  # noqa: E402

BLOCK_SIZE = 16
NAN_BLOCK = 0  # blocks a sequence has but must not read (outside its window) point here; only NaN in it
# Block-table entries past a sequence's blocks: far out of the cache, so reading one through such an
# entry faults (the test's process dies) instead of passing unnoticed.
GARBAGE_BLOCK = 2**30
# fp32: ~3e-7 measured. fp16: rounding of q/k/v is in the reference too; p rounds to fp16 before p @ v.
# bf16: the interpreter truncates fp32 -> bf16 (p before p @ v, and the output).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 4e-2}
RESULTS: list[dict] = []


@dataclass
class Step:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    scale: float


def build_step(
    seqs: list[tuple[int, int]],
    *,
    num_kv_heads: int = 2,
    queries_per_kv: int = 4,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    hide_before: list[int] | None = None,
) -> Step:
    """seqs: (query_len, seq_len) per sequence. hide_before[i]: the first key position sequence i may read
    (sliding-window tests): its blocks wholly before that point at the NaN block."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * queries_per_kv
    blocks_per_seq = [math.ceil(seq_len / BLOCK_SIZE) for _, seq_len in seqs]
    num_blocks = 1 + 2 * sum(blocks_per_seq) + 3  # the NaN block, the used ones, as many holes, and spares
    k_cache = torch.full((num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    free_ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 2
    block_table = torch.full((len(seqs), max_blocks), GARBAGE_BLOCK, dtype=torch.int32)
    for i, (_, seq_len) in enumerate(seqs):
        for b in range(blocks_per_seq[i]):
            block = free_ids.pop()
            free_ids.pop()  # a hole: the next id is left unused (NaN)
            slots = min(BLOCK_SIZE, seq_len - b * BLOCK_SIZE)
            shape = (slots, num_kv_heads, head_dim)
            k_cache[block, :slots] = torch.randn(shape, generator=gen).to(dtype)
            v_cache[block, :slots] = torch.randn(shape, generator=gen).to(dtype)
            hidden = hide_before is not None and (b + 1) * BLOCK_SIZE <= hide_before[i]
            block_table[i, b] = NAN_BLOCK if hidden else block
    query_lens = [query_len for query_len, _ in seqs]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], num_heads, head_dim), generator=gen).to(dtype)
    return Step(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def reference(step: Step, sliding_window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention, one sequence at a time: gather its keys through its block table, then SDPA with
    the causal (and window) mask. Returns the output and which rows it defines: every row of a sequence
    with real positions (padding, seq_len < query_len, has none)."""
    out = torch.zeros(step.q.shape, dtype=torch.float64)
    defined = torch.zeros(step.q.shape[0], dtype=torch.bool)
    num_heads, num_kv_heads = step.q.shape[1], step.k_cache.shape[2]
    starts = step.query_start_loc.tolist()
    for i, seq_len in enumerate(step.seq_lens.tolist()):
        begin, end = starts[i], starts[i + 1]
        query_len = end - begin
        if query_len == 0 or seq_len < query_len:
            continue
        # Keys before the first query's window are seen by no query (and their blocks may be NaN).
        first = max(0, seq_len - query_len - sliding_window + 1) if sliding_window else 0
        positions = torch.arange(first, seq_len)
        blocks = step.block_table[i, positions // BLOCK_SIZE].long()
        keys = step.k_cache[blocks, positions % BLOCK_SIZE].double()  # [keys, KVH, D]
        values = step.v_cache[blocks, positions % BLOCK_SIZE].double()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)  # [H, keys, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        mask = positions[None, :] <= query_pos
        if sliding_window:
            mask &= positions[None, :] > query_pos - sliding_window
        queries = step.q[begin:end].double().transpose(0, 1)  # [H, query_len, D]
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=step.scale)
        out[begin:end] = attended.transpose(0, 1)
        defined[begin:end] = True
    assert torch.isfinite(out).all(), "the reference read a NaN slot: the step builder is wrong"
    return out, defined


def run(step: Step, **kwargs) -> torch.Tensor:
    return paged_attention(
        step.q,
        step.k_cache,
        step.v_cache,
        step.block_table,
        step.query_start_loc,
        step.seq_lens,
        step.scale,
        check_indices=True,
        **kwargs,
    )


def check(case, name, got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor], dtype, tol=None) -> None:
    """Compare got with want = (output, rows it defines) on those rows, which must not be empty."""
    expected, rows = want
    assert rows.any(), f"{case}/{name}: no row to compare"
    diff = (got.double() - expected)[rows]
    max_err = float(diff.abs().max()) if torch.isfinite(diff).all() else math.inf
    tol = TOLERANCE[dtype] if tol is None else tol
    RESULTS.append({"case": case, "check": name, "dtype": str(dtype)[6:], "max_err": max_err, "tol": tol})


def record(case: str, name: str, dtype: torch.dtype, ok: bool) -> None:
    """A pass/fail check, reported like the numeric ones."""
    RESULTS.append(
        {"case": case, "check": name, "dtype": str(dtype)[6:], "max_err": 0.0 if ok else math.inf, "tol": 0.0}
    )


def attend_and_check(case: str, name: str, step: Step, dtype: torch.dtype, sliding_window: int = 0, **kw):
    got = run(step, sliding_window=sliding_window, **kw)
    check(case, name, got, reference(step, sliding_window), dtype)
    return got


def case_context_lengths() -> None:
    """Contexts 1, 15, 16, 17 and the next block boundaries, as decodes and as whole prefills."""
    lengths = [1, 15, 16, 17, 31, 32, 33]
    for dtype in (torch.float32, torch.float16):
        step = build_step([(1, n) for n in lengths], dtype=dtype)
        attend_and_check("context_lengths", "decodes", step, dtype)
        step = build_step([(n, n) for n in lengths[:4]] + [(1, n) for n in lengths[4:]], dtype=dtype, seed=1)
        attend_and_check("context_lengths", "prefills+decodes", step, dtype)


def case_mixed_step() -> None:
    """A chunked-prefill continuation, a prefix-cached query, a whole prompt and decodes in one launch."""
    seqs = [(20, 57), (5, 40), (33, 33), (1, 16), (1, 49), (1, 1), (2, 18)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        attend_and_check("mixed_step", "mixed", build_step(seqs, dtype=dtype), dtype)
    # A longer chunk: many query tiles, each walking a different number of key tiles.
    for dtype in (torch.float32, torch.float16):
        step = build_step([(130, 300), (1, 90)], dtype=dtype, seed=2)
        attend_and_check("mixed_step", "130-token chunk over 170 cached", step, dtype)


def case_gqa_groups() -> None:
    """1, 4 and 8 query heads per KV head (8 makes the prefill tile 8 tokens x 8 heads)."""
    seqs = [(19, 19), (7, 30), (1, 21)]
    for queries_per_kv in (1, 4, 8):
        for dtype in (torch.float32, torch.float16):
            step = build_step(seqs, queries_per_kv=queries_per_kv, dtype=dtype)
            attend_and_check("gqa_groups", f"queries_per_kv={queries_per_kv}", step, dtype)
            decodes = build_step([(1, 40), (1, 9)], queries_per_kv=queries_per_kv, dtype=dtype, seed=1)
            attend_and_check("gqa_groups", f"decodes queries_per_kv={queries_per_kv}", decodes, dtype)


def case_head_dims() -> None:
    """head_dim 128 and 80 (padded to 128 with masks); 64 is every other case's."""
    seqs = [(17, 17), (3, 35), (1, 20)]
    for head_dim in (128, 80):
        for dtype in (torch.float32, torch.float16):
            step = build_step(seqs, head_dim=head_dim, num_kv_heads=1, dtype=dtype)
            attend_and_check("head_dims", f"head_dim={head_dim}", step, dtype)


def case_sliding_window() -> None:
    """Windows smaller than the context and not multiples of 16; the blocks wholly before a sequence's
    first visible key point at NaN, so they must be skipped, not read and masked."""
    seqs = [(40, 40), (9, 50), (1, 60), (1, 3), (3, 37)]
    for window in (5, 21):
        for dtype in (torch.float32, torch.float16):
            # Sequence i's earliest visible key is that of its first query: seq_len - query_len - window + 1.
            hide = [max(0, seq_len - query_len - window + 1) for query_len, seq_len in seqs]
            step = build_step(seqs, dtype=dtype, hide_before=hide)
            attend_and_check("sliding_window", f"window={window}", step, dtype, sliding_window=window)
            decodes = build_step(
                [(1, 70), (1, 20)], dtype=dtype, seed=1, hide_before=[70 - window, 20 - window]
            )
            attend_and_check(
                "sliding_window", f"decodes window={window}", decodes, dtype, sliding_window=window
            )


def case_split_kv() -> None:
    """Split-KV decode: more splits than some sequences have key tiles (empty splits), with a window, and
    forced on a mixed step (the prefill tiling)."""
    seqs = [(1, 200), (1, 77), (1, 1), (1, 16)]
    for dtype in (torch.float32, torch.float16):
        step = build_step(seqs, dtype=dtype)
        whole = run(step, num_kv_splits=1)
        for splits in (4, 8):
            got = attend_and_check("split_kv", f"splits={splits}", step, dtype, num_kv_splits=splits)
            check("split_kv", f"splits={splits} vs unsplit", got, (whole.double(), reference(step)[1]), dtype)
        attend_and_check("split_kv", "splits=4 window=21", step, dtype, sliding_window=21, num_kv_splits=4)
        mixed = build_step([(20, 57), (1, 49), (5, 40)], dtype=dtype, seed=1)
        attend_and_check("split_kv", "splits=2 mixed step", mixed, dtype, num_kv_splits=2)
    step = build_step(seqs, dtype=torch.bfloat16)
    attend_and_check("split_kv", "splits=4", step, torch.bfloat16, num_kv_splits=4)


def _pad_bucket(step: Step, pads: int, mode: str) -> Step:
    """The step as a CUDA graph bucket of len(seqs) + pads sequences would present it."""
    num_seqs = step.seq_lens.shape[0]
    starts, lens, table = step.query_start_loc, step.seq_lens, step.block_table
    q = step.q
    if mode == "empty":  # padding sequences of no query; q has rows past the last one, all NaN
        starts = torch.cat([starts, starts[-1:].repeat(pads)])
        q = torch.cat([q, torch.full((pads, *q.shape[1:]), float("nan"), dtype=q.dtype)])
        lens = torch.cat([lens, torch.zeros(pads, dtype=torch.int32)])
    else:  # one query each, with no context ("zero") or one key in a reserved block ("reserved")
        starts = torch.cat([starts, starts[-1] + torch.arange(1, pads + 1, dtype=torch.int32)])
        q = torch.cat([q, torch.randn((pads, *q.shape[1:])).to(q.dtype)])
        lens = torch.cat([lens, torch.full((pads,), 0 if mode == "zero" else 1, dtype=torch.int32)])
    pad_rows = torch.full((pads, table.shape[1]), GARBAGE_BLOCK, dtype=torch.int32)
    k_cache, v_cache = step.k_cache, step.v_cache
    if mode == "reserved":
        reserved = k_cache.shape[0]  # a block of its own, appended, holding finite padding keys
        k_cache = torch.cat([k_cache, torch.randn((1, *k_cache.shape[1:])).to(k_cache.dtype)])
        v_cache = torch.cat([v_cache, torch.randn((1, *v_cache.shape[1:])).to(v_cache.dtype)])
        pad_rows[:, 0] = reserved
    assert starts.shape[0] == num_seqs + pads + 1
    return Step(q, k_cache, v_cache, torch.cat([table, pad_rows]), starts, lens, step.scale)


def case_padded_bucket() -> None:
    """Padding a decode batch to a graph bucket leaves the real rows' outputs bit for bit as they were,
    and rows past query_start_loc[S] are not written."""
    for dtype in (torch.float32, torch.float16):
        step = build_step([(1, 17), (1, 33), (1, 5)], dtype=dtype)
        for splits in (1, 4):
            bounds = {"max_query_len": 1, "max_seq_len": 64, "num_kv_splits": splits}
            real = run(step, **bounds)
            check("padded_bucket", f"splits={splits} unpadded", real, reference(step), dtype)
            for mode in ("empty", "zero", "reserved"):
                padded = _pad_bucket(step, 5, mode)
                out = torch.full_like(padded.q, 7.0)
                got = run(padded, out=out, **bounds)
                num_real = step.q.shape[0]
                exact = torch.equal(got[:num_real], real)
                record("padded_bucket", f"splits={splits} {mode}: real rows unchanged", dtype, exact)
                pad = got[num_real:]
                if mode == "reserved":  # each padding query sees its one reserved key
                    check(
                        "padded_bucket",
                        f"splits={splits} reserved: padding rows",
                        got,
                        reference(padded),
                        dtype,
                    )
                else:  # "empty": not written; "zero": no key visible gives zeros, not NaN
                    ok = bool((pad == (7.0 if mode == "empty" else 0.0)).all())
                    record("padded_bucket", f"splits={splits} {mode}: padding rows", dtype, ok)


if __name__ == "__main__":
    sys.exit(run_cases(globals(), RESULTS, sys.argv[1:]))
