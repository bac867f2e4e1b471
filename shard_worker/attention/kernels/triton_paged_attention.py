"""Paged attention in Triton: one launch serves a whole mixed step, reading keys and values in place.

A step is T query tokens of S sequences, each sequence's tokens contiguous; sequence i has q_len_i
queries at the end of its seq_len_i cached tokens (a prefill chunk, a continuation over a cached or
prefix-cached context, or a decode: all the same case). Keys and values stay in the paged cache
[num_blocks, block_size, kv_heads, head_dim] and are found through each sequence's block table row.

Tiling. A program owns one query tile of one sequence and one KV head. Its BLOCK_M rows are BLOCK_Q
consecutive query tokens x the queries_per_kv query heads that share that KV head (row r: token r //
queries_per_kv, head r % queries_per_kv; rows past BLOCK_Q * queries_per_kv are padding), so each key
tile is loaded once for every head of the group and tl.dot always has at least 16 rows (a GPU minimum).
The program walks BLOCK_N key positions at a time, looking up each position's physical block in the
block table, and keeps an online softmax (running max and sum in fp32, base 2) over them. The walk
covers only the keys some row of the tile can see: it stops at the last row's own position (causal)
and, with a sliding window, starts at the tile that holds the first row's oldest visible key; tiles
outside that range are never visited, and lanes outside it are never loaded: a value slot that holds
NaN would survive its zero weight in p @ v (0 x NaN), and a block-table entry past a sequence's blocks
may be any number. head_dim is padded to a power of two >= 16 with masks.

Grid (host ints only, so a launch needs no device sync and can be captured in a CUDA graph):
axis 0 = T // BLOCK_Q + S query tiles, an upper bound: sequence i's tiles are numbered from
query_start_loc[i] // BLOCK_Q + i, which leaves it at least ceil(q_len_i / BLOCK_Q) numbers, and each
program finds its sequence by a binary search over that strictly increasing start; programs past their
sequence's last tile exit at once. axis 1 = KV heads. axis 2 = KV splits.

Split KV (long-context decode, few sequences). With one program per (sequence, KV head) a handful of
decodes would leave most of the GPU idle while each walks thousands of keys; axis 2 then cuts each tile's
key range into NUM_SPLITS contiguous slices, each program writes its normalised partial output and its
log-sum-exp to a float32 workspace, and a second kernel combines the slices per (token, head). The host
rule is plan_kv_splits() in host.py, which launches these kernels and checks their arguments.

Correctness never depends on max_query_len or max_seq_len: they pick tile sizes and the split count (a
CUDA graph bucket's loose bounds are fine), while every range is computed on the device from the tensors.
Rows at or past query_start_loc[S] (padding of a graph bucket) are not written.

Sinks (gpt-oss; HAS_SINKS): each head's learned logit is one more term of its softmax's denominator
whose value is zero. Folded into the running max and sum once the walk is done, or, when the keys are
split, by the combine kernel alone (a split's partial output and log-sum-exp stay the keys' own).

Under Triton's interpreter (TRITON_INTERPRET=1 in the environment before this module is imported; CPU
tensors) tl.dot multiplies bf16 bit patterns, so host.py asks for dot inputs upcast to fp32 there.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile number (query_start_loc[i] // BLOCK_Q + i) is <= tile."""
    lo: tl.int32 = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # IEEE for fp32 inputs: a GPU would otherwise use tf32 (10-bit mantissa) while the interpreter is exact.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)


@triton.jit
def paged_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    block_table_ptr,  # [S, max_blocks] int32
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    partial_out_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] fp32 (split launches only)
    partial_lse_ptr,  # [T, H, NUM_SPLITS] fp32, base 2 (split launches only)
    sinks_ptr,  # [H] fp32, natural-log logits (HAS_SINKS only)
    num_seqs,
    num_heads,
    qk_scale,  # softmax scale x log2(e): scores are in base 2 from the start
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table_seq,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    first_q = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # the tile's first query, within its sequence
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # negative only for padding rows (seq_len 0): they see no key

    rows = tl.arange(0, BLOCK_M)
    row_q = first_q + rows // QUERIES_PER_KV
    row_head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (row_q < q_len)
    row_pos = context_len + row_q
    row_token = (q_begin + row_q).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q = tl.load(
        q_ptr + row_token[:, None] * stride_q_token + row_head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Keys some row of this tile may see: [kv_first, kv_end). The walk starts at kv_first's tile.
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    kv_end = tl.minimum(seq_len, context_len + last_q + 1)
    kv_first = tl.maximum(context_len + first_q - SLIDING_WINDOW + 1, 0) if SLIDING_WINDOW > 0 else 0
    walk_begin = (kv_first // BLOCK_N) * BLOCK_N
    num_tiles = tl.maximum(tl.cdiv(kv_end - walk_begin, BLOCK_N), 0)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    walk_lo = walk_begin + split * tiles_per_split * BLOCK_N
    walk_hi = tl.minimum(walk_lo + tiles_per_split * BLOCK_N, kv_end)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq

    for start in range(walk_lo, walk_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        # Lanes outside [kv_first, kv_end) are not loaded at all: their block-table entries may be
        # garbage and their value slots anything, NaN included (masking scores would not stop 0 x NaN).
        pos_valid = (pos >= kv_first) & (pos < kv_end)
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = tl.load(  # [HEAD_DIM_PAD, BLOCK_N]: already transposed for the product
            k_cache_ptr
            + block[None, :] * stride_k_block
            + slot[None, :] * stride_k_slot
            + kv_head * stride_k_head
            + dims[:, None],
            mask=dim_valid[:, None] & pos_valid[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_v_block
            + slot[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + dims[None, :],
            mask=pos_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        scores = _dot(q, k, UPCAST_DOT, IEEE_DOT) * qk_scale
        visible = row_valid[:, None] & pos_valid[None, :] & (pos[None, :] <= row_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > row_pos[:, None] - SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps max -inf; shifting by 0 then gives exp2(-inf) = 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT, IEEE_DOT)
        row_max = new_max

    if HAS_SINKS and NUM_SPLITS == 1:
        sink = tl.load(sinks_ptr + row_head, mask=row_valid, other=float("-inf")) * 1.4426950408889634
        new_max = tl.maximum(row_max, sink)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.exp2(sink - shift)
        acc = acc * rescale[:, None]
        row_max = new_max

    # Rows that saw no key (padding, an empty split) give 0, not 0 / 0.
    denom = tl.where(row_sum > 0, row_sum, 1.0)
    result = acc / denom[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr
            + row_token[:, None] * stride_out_token
            + row_head[:, None] * stride_out_head
            + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        part = (row_token * num_heads + row_head) * NUM_SPLITS + split
        tl.store(
            partial_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], result, mask=row_valid[:, None]
        )
        lse = tl.where(row_sum > 0, row_max + tl.log2(denom), float("-inf"))
        tl.store(partial_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def combine_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    sinks_ptr,  # [H] fp32 (HAS_SINKS only)
    query_start_loc_ptr,
    num_seqs,
    num_heads,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """out[token, head] = sum_s 2^(lse_s - M) * partial_s / sum_s 2^(lse_s - M), M = max_s lse_s (with a
    sink, one more term 2^(sink - M) in the denominator and M the larger of it and the lses)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return  # padding past the step's tokens: no split wrote it
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    part = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(partial_lse_ptr + part)
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)  # empty splits: lse -inf, weight 0
    partial = tl.load(
        partial_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=dim_valid[None, :], other=0.0
    )
    total = tl.sum(weight, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    result = tl.sum(partial * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_out_token + head * stride_out_head + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )
