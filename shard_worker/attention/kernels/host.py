"""The host side of the Triton kernels in triton_paged_attention.py (their tiling and grid are described
there): paged_attention(), which launches them, the rules that size their tiles and KV splits, and the
launch-time checks.

Everything here reads host metadata only (shapes, dtypes, strides, ints the caller knows), so a launch
never waits on the device and is CUDA-graph capturable. The checks mirror what a GPU would enforce or
what the kernels assume but the interpreter lets pass; each raises ValueError naming the argument and
the limit. The one check that reads device memory (block ids against num_blocks, query_start_loc and
seq_lens against the tensors' sizes) syncs, so it runs only with check_indices=True (tests, debugging).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from shard_worker.attention.kernels.triton_paged_attention import (
    combine_splits_kernel,
    paged_attention_kernel,
)

# Read once at import, as Triton itself does (the interpreter replaces @triton.jit when it decorates).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The accumulator is BLOCK_M x head_dim fp32 in registers and each pipeline stage holds a K and a V tile
# in shared memory; past 256 neither fits.
MAX_HEAD_DIM = 256
# One KV group's query heads must fit in one tile's rows (BLOCK_M <= 128).
MAX_QUERIES_PER_KV = 128
MAX_KV_SPLITS = 64
# A split shorter than this spends more on its partial write and the combine than it saves.
MIN_KEYS_PER_SPLIT = 256
# Software pipelining depth of the key loop: two K and V tiles in flight fit every plan's shared memory
# (at most ~70 KB at head_dim 256 fp32) on sm_80 and later.
NUM_STAGES = 2
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TilePlan:
    block_m: int  # rows of a query tile: block_q tokens x queries_per_kv heads, padded to a power of two
    block_q: int  # query tokens per tile
    block_n: int  # key positions per inner-loop step
    num_warps: int


def plan_tiles(queries_per_kv: int, max_query_len: int, head_dim: int, dtype: torch.dtype) -> TilePlan:
    """16-row tiles when every sequence fits in one (decodes, short speculative verifies: a decode fills
    only queries_per_kv rows whatever the tile), else taller tiles so that a prefill chunk reloads each
    key tile less often. Sizes and warps were chosen from ptxas' register counts for sm_90 (at most a few
    bytes of spill at head_dim 64-256, where 64-row fp32 tiles spilled 0.6-8 KB; the tests compile them),
    not from timings on a GPU."""
    rows_min = _decode_rows(queries_per_kv)
    head_dim_pad = _padded_head_dim(head_dim)
    itemsize = torch.finfo(dtype).bits // 8
    if max_query_len * queries_per_kv <= rows_min:
        block_m, block_n = rows_min, 16
    else:
        # fp32 (ieee: no tensor cores) and wide heads spill registers at 64 rows.
        block_m = max(64 if head_dim_pad * itemsize <= 256 else 32, rows_min)
        block_n = 16 if dtype == torch.float32 else 32
    num_warps = 8 if block_m * head_dim_pad * itemsize >= 8192 else 4
    return TilePlan(block_m, block_m // queries_per_kv, block_n, num_warps)


def _decode_rows(queries_per_kv: int) -> int:
    return max(16, triton.next_power_of_2(queries_per_kv))  # tl.dot needs 16 rows on a GPU


def plan_kv_splits(
    num_seqs: int, num_kv_heads: int, queries_per_kv: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """Slices each sequence's keys are cut into (1: no split), from host ints only.

    Only when every sequence is one query tile (decode-like steps) and num_seqs x num_kv_heads programs
    would leave streaming multiprocessors idle: then enough splits for about one program per SM, but no
    more than leaves each split MIN_KEYS_PER_SPLIT of max_seq_len's keys, rounded down to a power of two
    (the combine kernel's tile), at most MAX_KV_SPLITS. With a graph bucket's loose max_seq_len the count
    is fixed per bucket; splits past a sequence's real keys are empty and cost a store each."""
    if num_seqs == 0 or max_query_len * queries_per_kv > _decode_rows(queries_per_kv):
        return 1
    wanted = min(MAX_KV_SPLITS, -(-num_sms // (num_seqs * num_kv_heads)), max_seq_len // MIN_KEYS_PER_SPLIT)
    return 1 << int(math.log2(wanted)) if wanted >= 2 else 1


def kv_split_workspace_numel(num_tokens: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements a split launch uses: a partial output and a log-sum-exp per (token, head, split)."""
    return num_tokens * num_heads * num_splits * (_padded_head_dim(head_dim) + 1)


def _padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot's inner dimension is at least 16


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: split only when asked to
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    check_indices: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a step's queries over the paged cache, written to out ([T, H, D]) and returned.

    q [T, H, D]: the step's queries, each sequence's tokens contiguous and in order. k_cache, v_cache
    [num_blocks, block_size, KVH, D]: already hold this step's keys and values. block_table [S, max_blocks]
    int32; query_start_loc [S + 1] int32 (cumulative query lengths); seq_lens [S] int32 (tokens cached
    after this step: sequence i's queries sit at positions seq_lens[i] - q_len_i .. seq_lens[i] - 1).
    sliding_window: 0 for none, else a query at p sees keys j with p - sliding_window < j <= p.
    max_query_len, max_seq_len: host-known upper bounds (loose is fine; they only pick tiles and splits);
    None means T and max_blocks * block_size. num_kv_splits: None picks by plan_kv_splits(), 1 turns
    splitting off, a power of two forces it. workspace: float32, at least kv_split_workspace_numel()
    elements, used when splitting (allocated per call if None; pass a static one under a CUDA graph).
    check_indices: also check the index tensors' values against the cache (syncs with the device).
    sinks: [H] float32 on q's device, each head's sink logit (gpt-oss), or None.
    Rows at or past query_start_loc[S] are not written (zeros when out is None)."""
    num_tokens, num_heads, head_dim = _check_shapes(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens
    )
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    queries_per_kv = num_heads // num_kv_heads
    if out is None:
        out = torch.zeros_like(q)
    else:
        _check_out(out, q)
    _check_int("sliding_window", sliding_window)
    if sinks is not None and not (
        sinks.dtype == torch.float32
        and sinks.shape == (num_heads,)
        and sinks.is_contiguous()
        and sinks.device == q.device
    ):
        raise ValueError(f"sinks must be contiguous float32 [{num_heads}] on {q.device}")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite host float, got {scale!r}")
    max_query_len = num_tokens if max_query_len is None else _check_int("max_query_len", max_query_len)
    max_context = block_table.shape[1] * block_size
    max_seq_len = max_context if max_seq_len is None else _check_int("max_seq_len", max_seq_len)
    if num_kv_splits is None:
        num_kv_splits = plan_kv_splits(
            num_seqs, num_kv_heads, queries_per_kv, max_query_len, max_seq_len, _num_sms(q.device)
        )
    elif not (1 <= num_kv_splits <= MAX_KV_SPLITS and num_kv_splits & (num_kv_splits - 1) == 0):
        raise ValueError(
            f"num_kv_splits must be a power of two from 1 to {MAX_KV_SPLITS}, got {num_kv_splits}"
        )
    if check_indices:
        _check_index_values(block_table, query_start_loc, seq_lens, k_cache.shape[0], block_size, num_tokens,
                            max_query_len, max_seq_len)  # fmt: skip
    if num_tokens == 0 or num_seqs == 0:
        return out

    plan = plan_tiles(queries_per_kv, max_query_len, head_dim, q.dtype)
    head_dim_pad = _padded_head_dim(head_dim)
    partial_out = partial_lse = out  # placeholders when not splitting: the kernel never touches them
    if num_kv_splits > 1:
        needed = kv_split_workspace_numel(num_tokens, num_heads, head_dim, num_kv_splits)
        if workspace is None:
            workspace = torch.empty(needed, dtype=torch.float32, device=q.device)
        _check_workspace(workspace, q, needed)
        split_rows = num_tokens * num_heads * num_kv_splits
        partial_out = workspace[: split_rows * head_dim_pad]
        partial_lse = workspace[split_rows * head_dim_pad : split_rows * (head_dim_pad + 1)]

    constants = kernel_constants(
        plan, head_dim, queries_per_kv, block_size, q.dtype, sliding_window, num_kv_splits, sinks is not None
    )
    sinks_arg = out if sinks is None else sinks  # a placeholder the kernels never read without sinks
    grid = (num_tokens // plan.block_q + num_seqs, num_kv_heads, num_kv_splits)
    paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, partial_out, partial_lse,
        sinks_arg, num_seqs, num_heads, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        **constants, num_warps=plan.num_warps, num_stages=NUM_STAGES,
    )  # fmt: skip
    if num_kv_splits > 1:
        combine_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_lse, sinks_arg, query_start_loc, num_seqs, num_heads, out.stride(0),
            out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_kv_splits,
            HAS_SINKS=sinks is not None, num_warps=4,
        )  # fmt: skip
    return out


def kernel_constants(
    plan: TilePlan,
    head_dim: int,
    queries_per_kv: int,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: int,
    num_kv_splits: int,
    sinks: bool = False,
) -> dict[str, int | bool]:
    """paged_attention_kernel's constexpr arguments for a launch (the compile test builds the same)."""
    return {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": _padded_head_dim(head_dim),
        "QUERIES_PER_KV": queries_per_kv,
        "BLOCK_SIZE": block_size,
        "BLOCK_M": plan.block_m,
        "BLOCK_Q": plan.block_q,
        "BLOCK_N": plan.block_n,
        "SLIDING_WINDOW": sliding_window,
        "NUM_SPLITS": num_kv_splits,
        "UPCAST_DOT": INTERPRET,
        "IEEE_DOT": dtype == torch.float32,
        "HAS_SINKS": sinks,
    }


def _check_shapes(q, k_cache, v_cache, block_table, query_start_loc, seq_lens) -> tuple[int, int, int]:
    if not INTERPRET and q.device.type != "cuda":
        raise ValueError(
            f"q is on {q.device}: the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 in the "
            "environment before shard_worker.attention.kernels is imported (CPU tensors, slow; for tests)"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all tensors must be on one device")
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    num_tokens, num_heads, head_dim = q.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is outside 1..{MAX_HEAD_DIM} (registers and shared memory)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[3] != head_dim:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, kv_heads, {head_dim}], got {tuple(cache.shape)}"
            )
        if cache.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {cache.dtype}, q {q.dtype}: they must match")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    # Rows are loaded as contiguous head_dim vectors; the other strides are passed to the kernel.
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size (k_cache.shape[1]) must be a power of two, got {block_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"q's {num_heads} heads are not a multiple of the cache's {num_kv_heads} kv heads")
    if num_heads // num_kv_heads > MAX_QUERIES_PER_KV:
        raise ValueError(
            f"{num_heads // num_kv_heads} query heads per kv head exceed {MAX_QUERIES_PER_KV} "
            "(one tile's rows)"
        )
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.stride(0) != 1:
        raise ValueError(
            f"seq_lens must be a contiguous 1-D int32 tensor, got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    num_seqs = seq_lens.shape[0]
    if (query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_seqs + 1,)
            or query_start_loc.stride(0) != 1):  # fmt: skip
        raise ValueError(
            f"query_start_loc must be a contiguous int32 tensor of shape ({num_seqs + 1},) for {num_seqs} "
            f"sequences, got {query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"block_table must be int32 [{num_seqs}, max_blocks] for {num_seqs} sequences, got "
            f"{block_table.dtype} {tuple(block_table.shape)}"
        )
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous (stride {block_table.stride(1)})")
    return num_tokens, num_heads, head_dim


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must match q ({q.dtype} {tuple(q.shape)} on {q.device}), got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in its last dimension (stride {out.stride(-1)})")


def _check_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a host int >= 0, got {value!r}")
    return value


def _check_workspace(workspace: torch.Tensor, q: torch.Tensor, needed: int) -> None:
    if workspace.dtype != torch.float32 or workspace.device != q.device or not workspace.is_contiguous():
        raise ValueError(
            f"workspace must be a contiguous float32 tensor on {q.device}, got {workspace.dtype}"
        )
    if workspace.numel() < needed:
        raise ValueError(f"workspace has {workspace.numel()} elements; this split launch needs {needed}")


def _check_index_values(
    block_table, query_start_loc, seq_lens, num_blocks, block_size, num_tokens, max_query_len, max_seq_len
) -> None:
    """The value checks that read device memory (one sync): what would make the kernels read out of
    bounds, and host bounds that the step exceeds (a wrong graph bucket)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if (
        starts[0] != 0
        or any(b < a for a, b in zip(starts, starts[1:], strict=False))
        or starts[-1] > num_tokens
    ):
        raise ValueError(
            f"query_start_loc must rise from 0 to at most {num_tokens} (q's tokens), got {starts}"
        )
    query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    if query_lens and max(query_lens) > max_query_len:
        raise ValueError(
            f"max_query_len={max_query_len} is below the step's longest query ({max(query_lens)})"
        )
    if lens and (min(lens) < 0 or max(lens) > max_seq_len):
        raise ValueError(f"seq_lens must lie in 0..max_seq_len={max_seq_len}, got {min(lens)}..{max(lens)}")
    max_blocks = block_table.shape[1]
    for i, seq_len in enumerate(lens):
        used = -(-seq_len // block_size)
        if used > max_blocks:
            raise ValueError(
                f"seq_lens[{i}]={seq_len} needs {used} blocks; block_table has {max_blocks} columns"
            )
        ids = block_table[i, :used]
        if used and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"block_table[{i}] holds block ids outside 0..{num_blocks - 1} (num_blocks)")
