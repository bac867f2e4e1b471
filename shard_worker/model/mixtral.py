"""Mixtral: Mistral's attention (every layer over sliding_window when set) with a sparse MoE in place of
the MLP: num_local_experts experts, num_experts_per_tok of them per token, weighted by a softmax over the
chosen experts' router logits (transformers: a float32 softmax over all, top k, renormalised)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shard_worker.model.base import CausalLM
from shard_worker.model.config import EVERY_LAYER, ModelConfig
from shard_worker.model.layers.moe import SparseMoE
from shard_worker.model.layers.norm import RMSNorm
from shard_worker.model.layers.self_attention import SelfAttention
from shard_worker.parallel import TensorParallel


@dataclass(frozen=True)
class MixtralConfig(ModelConfig):
    num_experts: int
    num_experts_per_tok: int


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config: MixtralConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = SelfAttention(config, layer_idx, tp)
        # Named like the checkpoint's module.
        self.block_sparse_moe = SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_act,
            tp,
            renormalize=True,
            weights_in_model_dtype=False,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, ctx, kv_cache)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.block_sparse_moe(x)


class MixtralForCausalLM(CausalLM):
    config_class = MixtralConfig
    layer_class = MixtralDecoderLayer
    window_rule = EVERY_LAYER
    # Experts' w1 (gate), w3 (up) and w2 (down): `experts.<e>.w1.weight` fills part (e, 0) of
    # experts.gate_up_proj.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", None),
    }

    @classmethod
    def family_fields(cls, hf) -> dict:
        return {"num_experts": hf.num_local_experts, "num_experts_per_tok": hf.num_experts_per_tok}
