"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat batch of tokens and a paged KV cache.

Module and parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are merged
into qkv_proj and gate_up_proj (see PACKED_MODULES), so the loader maps names one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.attention import Attention, AttentionContext
from shard_worker.model.config import ModelConfig
from shard_worker.model.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shard_worker.parallel import TensorParallel

# Checkpoint projection name -> (our merged module, part index).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the model dtype: half types need the range, and it is exactly what the
        # transformers reference does, so our outputs can be compared with it closely.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed once per step in float32 exactly as transformers does
    (rather than a table over every position, which is large for long-context models)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer(
            "inv_freq", torch.tensor(config.rope_inv_freq, dtype=torch.float32), persistent=False
        )
        self.scale = config.rope_attention_scaling

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin for the step's positions (broadcast over heads)."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scale, emb.sin() * self.scale
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
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
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(self, x, cos, sin, ctx: AttentionContext, kv_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, kv_cache, ctx)
        return self.o_proj(o.reshape(o.shape[0], -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.self_attn = LlamaAttention(config, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, ctx: AttentionContext, kv_cache: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    """Named like the checkpoints' `model.` prefix."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """This rank's shard of the model. Construct under the target device and default dtype; every
    parameter is left uninitialised for the loader to fill."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaBody(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        attn = self.model.layers[0].self_attn
        self.num_local_kv_heads = attn.num_kv_heads
        self.queries_per_kv = attn.num_heads // attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx: AttentionContext,
        kv_caches: list[torch.Tensor],  # one per layer
    ) -> torch.Tensor:  # [T, hidden]
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, ctx, kv_cache)
        return self.model.norm(h)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits [N, vocab] on rank 0; None on the other ranks (which must still call this,
        since it gathers)."""
        return self.lm_head(hidden_rows)
