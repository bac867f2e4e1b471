"""gpt-oss (GptOssForCausalLM: openai/gpt-oss-20b and gpt-oss-120b).

Against Llama: biased q/k/v/o projections; a learned sink logit per head in each softmax's denominator;
sliding-window layers (128 tokens in the released models) alternating with full attention (layer_types,
one layer group each: common/kv_cache_spec.py); YaRN rope; and in every layer a sparse MoE whose router has
a bias and softmaxes over the top k logits only, and whose experts are biased with the clamped SwiGLU
(layers/moe.py: GptOssExperts). The released checkpoints store the experts in MXFP4 (quant/mxfp4.py,
decoded at load). Tensor parallel over heads (sinks split with them) and over each expert's features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shard_worker.model.base import CausalLM
from shard_worker.model.config import BY_LAYER_TYPE, ModelConfig
from shard_worker.model.layers.moe import GptOssMoE
from shard_worker.model.layers.norm import RMSNorm
from shard_worker.model.layers.self_attention import SelfAttention
from shard_worker.parallel import TensorParallel


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    num_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: GptOssConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = SelfAttention(config, layer_idx, tp, sinks=True)
        self.mlp = GptOssMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            tp,
            alpha=config.swiglu_alpha,
            limit=config.swiglu_limit,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, ctx, kv_cache)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)


class GptOssForCausalLM(CausalLM):
    config_class = GptOssConfig
    layer_class = GptOssDecoderLayer
    window_rule = BY_LAYER_TYPE
    # hidden_act is not read: the experts' activation is the clamped SwiGLU whatever it says.
    activations = ("silu",)

    @classmethod
    def family_fields(cls, hf) -> dict:
        return {
            "num_experts": hf.num_local_experts,
            "num_experts_per_tok": hf.num_experts_per_tok,
            "swiglu_alpha": float(getattr(hf, "swiglu_alpha", 1.702)),
            "swiglu_limit": float(getattr(hf, "swiglu_limit", 7.0)),
        }
