"""Llama 2/3 (and models shaped like them: Qwen2, with biases on q/k/v and optional sliding layers)."""

from __future__ import annotations

import torch
from torch import nn

from shard_worker.model.base import CausalLM
from shard_worker.model.classifier import sequence_classifier
from shard_worker.model.config import BY_LAYER_TYPE, ModelConfig
from shard_worker.model.layers.mlp import GatedMLP
from shard_worker.model.layers.norm import RMSNorm
from shard_worker.model.layers.self_attention import SelfAttention
from shard_worker.parallel import TensorParallel


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual. Families that differ only in the
    attention's per-head q/k norm or in the MLP (Qwen3, Qwen3-MoE) subclass it."""

    qk_norm: type[nn.Module] | None = None

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = SelfAttention(config, layer_idx, tp, qk_norm=self.qk_norm)
        self.mlp = self.make_mlp(config, layer_idx, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, ctx, kv_cache)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)

    def make_mlp(self, config: ModelConfig, layer_idx: int, tp: TensorParallel) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)


class LlamaForCausalLM(CausalLM):
    layer_class = LlamaDecoderLayer


LlamaForSequenceClassification = sequence_classifier(LlamaForCausalLM)


class Qwen2ForCausalLM(CausalLM):
    """Qwen2: biases on q/k/v (never on o); with use_sliding_window, layers from max_window_layers on
    attend over the window (transformers' layer_types say which)."""

    layer_class = LlamaDecoderLayer
    window_rule = BY_LAYER_TYPE

    @classmethod
    def family_fields(cls, hf) -> dict:
        return {"qkv_bias": True, "o_bias": False}
