"""Attention one sequence at a time in plain torch: any device, any dtype, exact.

Each sequence's visible blocks are gathered and attended with scaled_dot_product_attention. The
workspace is one sequence's context, and the cost is a Python loop over sequences per layer, so this is
the path of the float64 tests (compared with transformers) and the reference the other backends are
checked against, not a serving path for large batches. The CPU backend (cpu.py) runs its prefill chunks
through attend_sequence, where SDPA's tiled kernel is the fast way.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from shard_worker.attention.backend import AttentionBackend, AttentionContext, with_sinks
from shard_worker.attention.kv_dtype import as_bits, load

# Query dtypes whose additive mask numpy builds directly (0 where a key is seen, -inf where not).
ADDITIVE = {torch.float32: np.float32, torch.float64: np.float64}


def sequence_spans(batch) -> list[tuple[int, int, int]]:
    """(first step row, query length, context length) of each sequence, as Python ints."""
    starts = batch.query_lens_host.cumsum() - batch.query_lens_host
    return list(
        zip(starts.tolist(), batch.query_lens_host.tolist(), batch.seq_lens_host.tolist(), strict=True)
    )


def attend_sequence(
    layer,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table_row: torch.Tensor,
    start: int,
    q_len: int,
    c_len: int,
    image_spans: tuple[tuple[int, int], ...] = (),
    fast_sinks: bool = False,
) -> torch.Tensor:
    """[q_len, heads, head_dim]: the queries q[start : start + q_len] of one sequence (its last q_len
    positions of c_len) over its keys, causal, with the layer's window; a query inside one of
    image_spans (first, end) also sees that image's later keys (when the layer is image_bidirectional).
    fast_sinks: a layer's sinks through torch's CPU flash kernel and its log-sum-exp (the CPU backend's
    prompts) rather than the scores written out."""
    bs = kv_cache.shape[2]
    window = layer.sliding_window
    # Keys before the first query's window are never seen: their blocks are not read.
    first_key = 0 if window is None else max(0, c_len - q_len - window + 1)
    first_block = first_key // bs
    blocks = table_row[first_block : -(-c_len // bs)]
    base = first_block * bs
    keys = as_bits(kv_cache[0]).index_select(0, blocks).view(kv_cache.dtype)
    values = as_bits(kv_cache[1]).index_select(0, blocks).view(kv_cache.dtype)
    keys = load(keys.flatten(0, 1)[: c_len - base], q.dtype, layer.k_scale).transpose(0, 1)
    values = load(values.flatten(0, 1)[: c_len - base], q.dtype, layer.v_scale).transpose(0, 1)
    mask = None
    if q_len > 1 or first_key > base:
        mask = _mask(base, c_len, q_len, window, image_spans if layer.image_bidirectional else ())
    if layer.sinks is not None:
        bool_mask = None if mask is None else torch.from_numpy(mask).to(q.device)
        if fast_sinks and q.device.type == "cpu":
            return _flash_with_sinks(layer, q[start : start + q_len], keys, values, bool_mask)
        return _attend_with_sinks(layer, q[start : start + q_len], keys, values, bool_mask)
    if mask is not None:
        if q.dtype in ADDITIVE:  # what SDPA would turn a bool mask into, with one more op
            mask = np.where(mask, 0.0, -np.inf).astype(ADDITIVE[q.dtype])
        mask = torch.from_numpy(mask).to(q.device, non_blocking=True)
    # With a batch dimension: torch's CPU flash kernel takes 4-d inputs only, and 3-d ones fall back to
    # the unfused math path (a 512-token prompt: 50 against 20 ms a layer).
    o = F.scaled_dot_product_attention(
        q[start : start + q_len].transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        scale=layer.scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def _mask(base: int, c_len: int, q_len: int, window: int | None, image_spans) -> np.ndarray:
    """[q_len, c_len - base] bool: which keys (positions base..c_len-1) each query (the last q_len
    positions) sees. Built with numpy on the host: a handful of torch ops on a small mask each cost a
    parallel region, milliseconds apiece on a loaded CPU, per sequence and layer."""
    key_pos = np.arange(base, c_len)
    query_pos = np.arange(c_len - q_len, c_len)[:, None]
    mask = key_pos <= query_pos
    for first, end in image_spans:  # an image's tokens see each other both ways
        rows = slice(max(first - (c_len - q_len), 0), max(end - (c_len - q_len), 0))
        mask[rows, max(first - base, 0) : max(end - base, 0)] = True
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


def _attend_with_sinks(
    layer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask
) -> torch.Tensor:
    """[q_len, heads, d], written out: each head's scores, its sink's logit as one more column of the
    softmax, that column's weight dropped (its value is zero). keys and values [kv_heads, keys, d]."""
    rep = layer.queries_per_kv
    keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    scores = torch.einsum("qhd,hkd->hqk", q, keys) * layer.scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sinks = layer.sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    weights = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
    return torch.einsum("hqk,hkd->qhd", weights, values)


def _flash_with_sinks(layer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    """_attend_with_sinks' result from torch's CPU flash kernel, which also returns each row's log-sum-exp
    of scores: the sinks then scale its output (backend.with_sinks). A prompt of gpt-oss's then costs
    what SDPA costs, not a [heads, q_len, keys] score tensor written out (3.3x slower at 1,900 tokens)."""
    rep = layer.queries_per_kv
    keys, values = keys.repeat_interleave(rep, 0)[None], values.repeat_interleave(rep, 0)[None]
    bias = None
    if mask is not None:  # the kernel takes an additive mask of the queries' dtype
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))[None, None]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], keys, values, 0.0, False, attn_mask=bias, scale=layer.scale
    )
    return with_sinks(out[0], lse[0], layer.sinks[:, None]).transpose(0, 1)


class ReferenceBackend(AttentionBackend):
    name = "reference"
    supports_sinks = True
    supports_image_spans = True

    def prepare(self, batch):
        # The loop below needs the lengths as Python ints; reading them once per step, not per layer.
        return sequence_spans(batch)

    def attend(self, layer, q: torch.Tensor, kv_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        table, spans = ctx.batch.block_table, ctx.batch.image_spans
        out = torch.empty_like(q)
        for seq, (start, q_len, c_len) in enumerate(ctx.metadata):
            images = spans[seq] if spans else ()
            out[start : start + q_len] = attend_sequence(
                layer, q, kv_cache, table[seq], start, q_len, c_len, images
            )
        return out
