"""DeepSeek-V3 (and DeepSeek-R1, Kimi K2: the same architecture): multi-head latent attention
(layers/mla.py, a paged latent per token: common/kv_cache_spec.py MLASpec) and, after the first
first_k_dense_replace dense layers, a MoE of n_routed_experts routed experts (group-limited top-k with the
correction bias, noaux_tc: layers/moe.py route_grouped) plus n_shared_experts always-on experts, as one
gated MLP. YaRN rope on the qk_rope_head_dim rotated dims, mscale_all_dim folded into the softmax scale.

Left out: the multi-token-prediction layer (the checkpoint's layers past num_hidden_layers are skipped),
and the released block-fp8 weights (quant_method fp8 is refused at start: a bf16 conversion is served).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from shard_worker.model.base import CausalLM
from shard_worker.model.config import ModelConfig, refuse_if_set
from shard_worker.model.layers.mla import MultiHeadLatentAttention
from shard_worker.model.layers.mlp import GatedMLP
from shard_worker.model.layers.moe import FusedMoE, GroupLimitedRouter, route_grouped
from shard_worker.model.layers.norm import RMSNorm
from shard_worker.model.layers.rotary import yarn_softmax_scale
from shard_worker.parallel import TensorParallel


@dataclass(frozen=True)
class DeepseekV3Config(ModelConfig):
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite's shape)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int


class DeepseekV3MoE(nn.Module):
    """Routed experts (sharded like every MoE here: each rank a slice of every expert's features) plus
    the shared experts' MLP; both partial sums all-reduced once."""

    def __init__(self, c: DeepseekV3Config, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.c = c
        self.gate = GroupLimitedRouter(c.hidden_size, c.n_routed_experts)
        self.experts = FusedMoE(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.hidden_act, tp)
        self.shared_experts = None
        if c.n_shared_experts:
            size = c.moe_intermediate_size * c.n_shared_experts
            self.shared_experts = GatedMLP(c.hidden_size, size, c.hidden_act, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        weights, ids = route_grouped(
            self.gate(x),
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        y = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts
            gate, up = shared.gate_up_proj(x).chunk(2, dim=-1)
            y = y + shared.down_proj.forward_partial(shared.act(gate) * up)
        return self.tp.all_reduce(y)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(config, tp)
        if layer_idx < config.first_k_dense_replace:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
        else:
            self.mlp = DeepseekV3MoE(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, ctx, kv_cache)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)


class DeepseekV3ForCausalLM(CausalLM):
    config_class = DeepseekV3Config
    layer_class = DeepseekV3DecoderLayer
    kv_block_dim = 0  # the latent cache is [blocks, block_size, latent]
    # q_proj is its own (no k/v beside it); the dense and shared MLPs merge gate and up.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One latent a token, every head's (replicated across ranks): kv_lora_rank + qk_rope_head_dim."""
        return (num_blocks, block_size, self.config.kv_lora_rank + self.config.qk_rope_head_dim)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """The multi-token-prediction layers (model.layers.<num_hidden_layers>... in DeepSeek's
        checkpoints), which are not served."""
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= self.config.num_layers

    @classmethod
    def family_fields(cls, hf) -> dict:
        refuse_if_set(hf, "attention_bias")
        if getattr(hf, "scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"scoring_func {hf.scoring_func!r} is not supported (only sigmoid)")
        if getattr(hf, "topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"topk_method {hf.topk_method!r} is not supported (only noaux_tc)")
        if getattr(hf, "moe_layer_freq", 1) != 1:
            raise ValueError(f"moe_layer_freq {hf.moe_layer_freq} is not supported (only 1)")
        experts, groups = hf.n_routed_experts, hf.n_group or 1
        if experts % groups or experts // groups < 2:
            raise ValueError(f"n_routed_experts {experts} does not split into n_group {groups} of 2 or more")
        qk_head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        params = getattr(hf, "rope_parameters", None) or {}
        return {
            "q_lora_rank": hf.q_lora_rank,
            "kv_lora_rank": hf.kv_lora_rank,
            "qk_nope_head_dim": hf.qk_nope_head_dim,
            "qk_rope_head_dim": hf.qk_rope_head_dim,
            "v_head_dim": hf.v_head_dim,
            "rope_interleave": bool(getattr(hf, "rope_interleave", True)),
            "softmax_scale": yarn_softmax_scale(params, qk_head_dim**-0.5),
            "n_routed_experts": experts,
            "n_shared_experts": hf.n_shared_experts or 0,
            "num_experts_per_tok": hf.num_experts_per_tok,
            "moe_intermediate_size": hf.moe_intermediate_size,
            "n_group": groups,
            "topk_group": hf.topk_group or 1,
            "routed_scaling_factor": float(hf.routed_scaling_factor),
            "norm_topk_prob": bool(hf.norm_topk_prob),
            "first_k_dense_replace": hf.first_k_dense_replace or 0,
        }
