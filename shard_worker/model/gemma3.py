"""Gemma 3, text only (Gemma3ForCausalLM: the 270M and 1B checkpoints; the larger ones are multimodal).

Against Llama: (1 + w) RMS norms in float32, on the hidden states and on each query and key head; four
norms per layer (around attention and around the MLP, each output normed before the residual add); the
embedding scaled by sqrt(hidden_size), rounded to the model dtype first as transformers does; gelu-tanh
MLP; attention scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5; and local sliding
layers interleaved with global ones (layer_types), each kind with its own rope (rope_parameters per
layer type: local theta 10k, global 1M with the larger models' linear scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shard_worker.model.base import CausalLM
from shard_worker.model.config import BY_LAYER_TYPE, ModelConfig, refuse_if_set
from shard_worker.model.layers.mlp import GatedMLP
from shard_worker.model.layers.norm import GemmaRMSNorm
from shard_worker.model.layers.self_attention import SelfAttention
from shard_worker.parallel import TensorParallel


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    query_pre_attn_scalar: float


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_idx: int, tp: TensorParallel):
        super().__init__()
        scale = config.query_pre_attn_scalar**-0.5
        self.self_attn = SelfAttention(config, layer_idx, tp, qk_norm=GemmaRMSNorm, scale=scale)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, h, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, ctx, kv_cache)
        h, x = self.pre_feedforward_layernorm.add_forward(h, self.post_attention_layernorm(a))
        return h + self.post_feedforward_layernorm(self.mlp(x))


class Gemma3ForCausalLM(CausalLM):
    config_class = Gemma3Config
    layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm
    window_rule = BY_LAYER_TYPE
    rope_by_layer_type = True
    activations = ("gelu_pytorch_tanh",)

    def __init__(self, config: Gemma3Config, tp: TensorParallel):
        super().__init__(config, tp)
        # A float32 scalar cast to the model dtype, as transformers' scaled embedding does.
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer("embed_scale", scale.to(torch.get_default_dtype()), persistent=False)

    @classmethod
    def family_fields(cls, hf) -> dict:
        # EmbeddingGemma's bidirectional attention is not a causal LM's.
        refuse_if_set(hf, "use_bidirectional_attention")
        return {"hidden_act": hf.hidden_activation, "query_pre_attn_scalar": hf.query_pre_attn_scalar}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.embed_scale
