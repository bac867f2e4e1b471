"""The attention block of a decoder layer: q/k/v projections (one column-parallel matmul), optional
per-head q/k norms, rotary, paged attention over this rank's heads, and the row-parallel o projection."""

from __future__ import annotations

import torch
from torch import nn

from shard_worker.attention import Attention, cpu_ops
from shard_worker.model.config import ModelConfig
from shard_worker.model.layers.linear import QKVParallelLinear, RowParallelLinear, copy_checked
from shard_worker.model.layers.rotary import apply_rotary
from shard_worker.parallel import TensorParallel


class SelfAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        tp: TensorParallel,
        qk_norm: type[nn.Module] | None = None,
        scale: float | None = None,
        sinks: bool = False,
    ):
        """qk_norm: the norm class applied to each query and key head before rotary (Qwen3, Gemma 3);
        scale: the attention scale, head_dim ** -0.5 unless the family says otherwise; sinks: a learned
        logit per head in each softmax's denominator (gpt-oss: `self_attn.sinks`, split by heads)."""
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            tp,
            bias=config.qkv_bias,
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, tp, bias=config.o_bias
        )
        self.q_norm = qk_norm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5 if scale is None else scale,
            sliding_window=config.sliding_windows[layer_idx],
        )
        if sinks:
            self.tp = tp
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
            # The backend reads the layer's; a view of the parameter, so the loaded values are what it
            # sees (a parameter of its own would be a second, never-filled entry for the loader).
            self.attn.sinks = self.sinks.detach()

    def _load_sinks(self, param: nn.Parameter, source, part=None) -> None:
        start = self.tp.rank * self.num_heads
        copy_checked(param.data, source, slice(start, start + self.num_heads), "self_attn.sinks")

    def forward(self, x: torch.Tensor, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        if not cpu_ops.rotary_(q, k, cos, sin):  # in place on CPU, one call for both
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, ctx)
        return self.o_proj(o.reshape(o.shape[0], -1))
