"""Qwen3-MoE: Qwen3's attention (q/k norms; every layer over sliding_window when use_sliding_window) with a
sparse MoE in most layers: a float32 softmax over all experts, the top k, renormalised when
norm_topk_prob, cast to the model dtype. Layers in mlp_only_layers, or off the decoder_sparse_step
stride, keep a dense MLP of intermediate_size; the experts are moe_intermediate_size wide."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shard_worker.model.base import CausalLM
from shard_worker.model.config import EVERY_LAYER, ModelConfig
from shard_worker.model.layers.mlp import GatedMLP
from shard_worker.model.layers.moe import SparseMoE
from shard_worker.model.qwen3 import Qwen3DecoderLayer
from shard_worker.parallel import TensorParallel


@dataclass(frozen=True)
class Qwen3MoeConfig(ModelConfig):
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: Qwen3MoeConfig, layer_idx: int, tp: TensorParallel) -> nn.Module:
        if not config.sparse_layers[layer_idx]:
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_act,
            tp,
            renormalize=config.norm_topk_prob,
            weights_in_model_dtype=True,
        )


class Qwen3MoeForCausalLM(CausalLM):
    config_class = Qwen3MoeConfig
    layer_class = Qwen3MoeDecoderLayer
    window_rule = EVERY_LAYER
    # Experts' tensors are named like a dense MLP's (experts.<e>.gate_proj ...): the Llama mapping.

    @classmethod
    def family_fields(cls, hf) -> dict:
        dense = set(hf.mlp_only_layers or ())
        sparse = tuple(
            i not in dense and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
            for i in range(hf.num_hidden_layers)
        )
        return {
            "num_experts": hf.num_experts,
            "num_experts_per_tok": hf.num_experts_per_tok,
            "moe_intermediate_size": hf.moe_intermediate_size,
            "norm_topk_prob": bool(hf.norm_topk_prob),
            "sparse_layers": sparse,
        }
