"""DeepSeek's multi-head latent attention block: the query through a low-rank bottleneck (q_a_proj,
q_a_layernorm, q_b_proj; or one q_proj where q_lora_rank is None, as in DeepSeek-V2-Lite's shape), one
latent per token (kv_a_proj_with_mqa: kv_lora_rank values, normed, and a rope_dim key part shared by the
heads, rotated), paged attention over the cached latents (attention/latent.py), the row-parallel o_proj.

Tensor parallel over heads: q_b_proj (or q_proj) and kv_b_proj are split by heads (their rows are laid
out head after head), o_proj by its inputs; q_a_proj and kv_a_proj_with_mqa, the norms and so the latent
are replicated, so every rank caches the same latent and attends with its own heads.

kv_b_proj is a plain weight (KVUpProjection), not a linear layer with a method: the absorbed form reads
it as W_UK and W_UV per head, which a repacked or quantized layout would hide.
"""

from __future__ import annotations

import torch
from torch import nn

from shard_worker.attention.latent import LatentAttention
from shard_worker.model.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_checked,
    divide,
    new_param,
)
from shard_worker.model.layers.norm import RMSNorm
from shard_worker.model.layers.rotary import apply_rotary
from shard_worker.parallel import TensorParallel


class KVUpProjection(nn.Module):
    """kv_b_proj's rows for this rank's heads: [local heads * (nope + v), kv_lora_rank]."""

    def __init__(self, kv_lora_rank: int, num_heads: int, per_head: int, tp: TensorParallel):
        super().__init__()
        local = divide(num_heads, tp.world_size, "num_attention_heads") * per_head
        self.first_row = tp.rank * local
        self.weight = new_param(local, kv_lora_rank)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source, part=None) -> None:
        rows = slice(self.first_row, self.first_row + param.shape[0])
        copy_checked(param.data, source, (rows, slice(None)), "kv_b_proj")


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs laid out (x0, x1), (x2, x3), ... (DeepSeek's checkpoints: rope_interleave) moved to
    the halves the rotate-half rope pairs, [x0, x2, ...; x1, x3, ...]: the same rotation, as transformers
    computes it."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config, tp: TensorParallel):
        """config: a DeepseekV3Config (shard_worker/model/deepseek_v3.py) or anything with its fields."""
        super().__init__()
        c = config
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.interleave = c.rope_interleave
        qk_head_dim = self.nope + self.rope_dim
        self.q_lora = c.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = ColumnParallelLinear(c.hidden_size, c.num_heads * qk_head_dim, tp)
        else:
            self.q_a_proj = ReplicatedLinear(c.hidden_size, c.q_lora_rank)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, c.num_heads * qk_head_dim, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, c.kv_lora_rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = KVUpProjection(c.kv_lora_rank, c.num_heads, self.nope + self.v_dim, tp)
        self.o_proj = RowParallelLinear(c.num_heads * self.v_dim, c.hidden_size, tp)
        self.num_heads = c.num_heads // tp.world_size
        self.attn = LatentAttention(
            self.num_heads, c.kv_lora_rank, self.rope_dim, self.nope, self.v_dim, c.softmax_scale
        )

    def forward(self, x: torch.Tensor, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(-1, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        if self.interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        cos, sin = rope
        q_pe = apply_rotary(q_pe, cos, sin)
        k_pe = apply_rotary(k_pe[:, None], cos, sin)[:, 0]
        latent = torch.cat([c, k_pe], dim=-1)
        o = self.attn(q_nope, q_pe, latent, self.kv_b_proj.weight, kv_cache, ctx)
        return self.o_proj(o.reshape(o.shape[0], -1))
