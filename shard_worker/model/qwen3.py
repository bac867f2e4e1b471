"""Qwen3 (dense): Llama's layout with an RMSNorm over each query and key head before rotary, no q/k/v bias
unless attention_bias, and Qwen2's optional sliding layers."""

from __future__ import annotations

import torch
from torch import nn

from shard_worker.model.base import CausalLM
from shard_worker.model.config import BY_LAYER_TYPE, ModelConfig
from shard_worker.model.layers.mlp import GatedMLP
from shard_worker.model.layers.norm import RMSNorm
from shard_worker.model.layers.self_attention import SelfAttention
from shard_worker.parallel import TensorParallel


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = SelfAttention(config, layer_idx, tp, qk_norm=RMSNorm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, ctx, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3ForCausalLM(CausalLM):
    layer_class = Qwen3DecoderLayer
    window_rule = BY_LAYER_TYPE
