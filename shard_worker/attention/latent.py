"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in torch.

A layer's cache is [num_blocks, block_size, kv_lora_rank + rope_dim]: per token one latent c (the
compressed K and V of every head, after kv_a_layernorm) and one rotated key part k_pe shared by the
heads (common/kv_cache_spec.py MLASpec). The same on every tensor-parallel rank; each rank's heads read it.
Per head h, with W_UK[h] [nope, R] and W_UV[h] [v, R] the rows of kv_b_proj for that head:

    k_h = [W_UK[h] c ; k_pe]      v_h = W_UV[h] c
    score = (q_nope . W_UK[h] c + q_pe . k_pe) * scale = ([W_UK[h]^T q_nope ; q_pe] . [c ; k_pe]) * scale
    out_h = sum_j p_j W_UV[h] c_j = W_UV[h] (sum_j p_j c_j)

so a query can be absorbed: folded into the latent's space once (W_UK[h]^T q_nope), attended over the
cached [c ; k_pe] directly as one key head of R + rope_dim shared by every query head (values: c), and
W_UV applied once to the weighted latent. Nothing per key is expanded: that is the decode form. Expanding
(every key through kv_b_proj, then ordinary attention) costs R * (nope + v) per key and head, and the
absorbed form q_len * (2R + rope_dim): each sequence takes whichever is cheaper, so decodes absorb and
long prefill chunks expand (DeepSeek's own split, and vLLM's).

One sequence at a time through its block table, each with torch's SDPA, like the reference backend
(attention/reference.py): the backends that run MLA layers are cpu, flex and reference (whose contexts
carry the step's block tables); triton has no MLA kernel and refuses such a model at start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.attention.backend import AttentionContext
from shard_worker.attention.kv_dtype import as_bits, load, store
from shard_worker.attention.reference import sequence_spans

ABSORB = ("auto", "always", "never")


class LatentAttention(nn.Module):
    """Paged MLA of one layer, with this rank's heads. Holds no weights: the layer passes kv_b_proj's
    (this rank's rows, [heads * (nope + v), R]) with each call."""

    sliding_window = None  # every query reads every key before it
    sinks = None
    num_kv_heads = 1  # one latent for every head

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_dim: int, scale):
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.nope_dim = nope_dim
        self.v_dim = v_dim
        self.latent_dim = kv_lora_rank + rope_dim
        self.head_dim = nope_dim + rope_dim
        self.scale = scale
        self.kv_group = 0  # its layer group (common/kv_cache_spec.py); set by the runner's layout
        # auto: per sequence, the cheaper form; always/never: the absorbed form or expanded K/V for
        # every sequence (bench/mla_decode.py compares them).
        self.absorb = "auto"

    def absorbs(self, q_len: int) -> bool:
        if self.absorb != "auto":
            return self.absorb == "always"
        r = self.kv_lora_rank
        return q_len * (2 * r + self.rope_dim) <= r * (self.nope_dim + self.v_dim)

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, heads, nope]
        q_pe: torch.Tensor,  # [T, heads, rope_dim], rotated
        latent: torch.Tensor,  # [T, R + rope_dim]: c (normed) and k_pe (rotated)
        kv_b: torch.Tensor,  # [heads * (nope + v), R]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, R + rope_dim]
        ctx: AttentionContext,
    ) -> torch.Tensor:  # [T, heads, v]
        if ctx.groups:
            ctx = ctx.groups[self.kv_group]
        batch = ctx.batch
        write_latent(kv_cache, latent, batch.slot_mapping)
        w = kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        spans = sequence_spans(batch)
        absorbed = [self.absorbs(q_len) for _, q_len, _ in spans]
        # W_UK^T q_nope for every token at once ([heads, T, R]), when any sequence attends absorbed.
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk) if any(absorbed) else None
        bs = kv_cache.shape[1]
        for seq, (start, q_len, c_len) in enumerate(spans):
            blocks = batch.block_table[seq, : -(-c_len // bs)]
            cached = as_bits(kv_cache).index_select(0, blocks).view(kv_cache.dtype).flatten(0, 1)[:c_len]
            cached = load(cached, q_nope.dtype)
            mask = None
            if q_len > 1:
                key_pos = torch.arange(c_len, device=q_nope.device)
                mask = key_pos <= torch.arange(c_len - q_len, c_len, device=q_nope.device)[:, None]
            rows = slice(start, start + q_len)
            if absorbed[seq]:
                out[rows] = self._absorbed(q_lat[:, rows], q_pe[rows], cached, w_uv, mask)
            else:
                out[rows] = self._expanded(q_nope[rows], q_pe[rows], cached, kv_b, mask)
        return out

    def _absorbed(self, q_lat, q_pe, cached, w_uv, mask) -> torch.Tensor:
        """q_lat [heads, q, R], q_pe [q, heads, rope]; cached [keys, R + rope] is every head's key, and
        its first R values every head's value. The heads are folded into the query rows: one product
        reads each key once for all of them."""
        heads, q_len = q_lat.shape[0], q_lat.shape[1]
        q = torch.cat([q_lat, q_pe.transpose(0, 1)], dim=-1).reshape(1, heads * q_len, -1)
        if mask is not None:
            mask = mask.repeat(heads, 1)  # rows head-major, like q's
        o = attend(q, cached[None], cached[None, :, : self.kv_lora_rank], mask, self.scale)
        # [heads, q, R] x [heads, R, v]: W_UV once, on the weighted latent.
        return torch.bmm(o.view(heads, q_len, -1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expanded(self, q_nope, q_pe, cached, kv_b, mask) -> torch.Tensor:
        """Every key and value expanded from the latent through kv_b_proj, then attention per head."""
        n = cached.shape[0]
        kv = F.linear(cached[:, : self.kv_lora_rank], kv_b).view(n, self.num_heads, -1)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = cached[:, None, self.kv_lora_rank :].expand(n, self.num_heads, self.rope_dim)
        keys = torch.cat([k_nope, k_pe], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = attend(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), mask, self.scale)
        return o.transpose(0, 1)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, latent={self.kv_lora_rank}+{self.rope_dim}, "
            f"qk_nope={self.nope_dim}, v={self.v_dim}"
        )


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """[B, q, dv]: softmax(q k^T * scale) v per batch entry, the softmax in float32 at least (as SDPA's
    math path). Written out: SDPA's CPU math path (these head dims are not flash's) took 10x longer at a
    4k context, in its masking and in copying transposed keys."""
    scores = torch.baddbmm(q.new_zeros(()), q, keys.transpose(1, 2), beta=0, alpha=scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return torch.bmm(weights.to(values.dtype), values)


def write_latent(kv_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores the step's latents at their slots, rounded to the cache's dtype (one indexed copy)."""
    slots = as_bits(kv_cache.view(-1, kv_cache.shape[-1]))
    slots.index_copy_(0, slot_mapping, as_bits(store(latent, kv_cache.dtype)))
