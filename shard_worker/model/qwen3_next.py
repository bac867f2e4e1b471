"""Qwen3-Next: Gated DeltaNet linear-attention layers (layers/gated_deltanet.py) between gated full
attention layers (layer_types; three of four linear in the released checkpoints), every layer's MLP a
sparse MoE with a shared expert whose output a sigmoid gate scales.

Full attention as transformers' Qwen3NextAttention: q_proj gives each query head a gate beside it
([query; gate] per head), (1 + w) RMSNorms over each query and key head, rotary over the first
partial_rotary_factor of each head, the attention output times sigmoid(gate) before o_proj. Norms are
(1 + w) in float32 (Gemma's), the linear layers' gated norm plain weight * normalised.

Only the full-attention layers keep K and V (the paged cache's layers); the linear ones keep a state slot
per sequence (common/kv_cache_spec.py RecurrentStateSpec), which the runner passes in as state_caches
with the step's StateStep. Tensor parallelism: attention heads, linear-attention key heads (with their
value heads), expert features and the shared expert's, each split across ranks; one all-reduce for
the mixer and one for the MoE (routed and shared experts summed before it).
Not served: the multi-token-prediction layer (mtp.* tensors, ignored), speculative decoding of any kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shard_worker.attention import Attention
from shard_worker.model.base import CausalLM
from shard_worker.model.config import ModelConfig
from shard_worker.model.layers.gated_deltanet import GatedDeltaNet
from shard_worker.model.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from shard_worker.model.layers.mlp import GatedMLP
from shard_worker.model.layers.moe import FusedMoE, route
from shard_worker.model.layers.norm import GemmaRMSNorm
from shard_worker.model.layers.rotary import apply_rotary
from shard_worker.parallel import TensorParallel

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen3NextConfig(ModelConfig):
    linear_layers: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or gated full attention
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP


class GatedAttention(nn.Module):
    def __init__(self, config: Qwen3NextConfig, tp: TensorParallel):
        super().__init__()
        self.head_dim = hd = config.head_dim
        # [query; gate] per head reads as two heads' rows: the q part splits across ranks by head whole.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, hd, 2 * config.num_heads, config.num_kv_heads, tp
        )
        self.num_heads = self.qkv_proj.num_local_heads // 2
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * hd, config.hidden_size, tp)
        self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, scale=hd**-0.5)

    def forward(self, x: torch.Tensor, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        qg, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        q, gate = qg.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.attn(q, k, v.view(tokens, self.num_kv_heads, self.head_dim), kv_cache, ctx)
        o = o.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(o)


class SharedExpertMoE(nn.Module):
    """Routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x)); one all-reduce for
    both (the gate is per token, so it scales each rank's partial sum alike)."""

    def __init__(self, config: Qwen3NextConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, config.hidden_act, tp
        )
        self.shared_expert = GatedMLP(
            config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act, tp
        )
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, x.dtype)
        routed = self.experts(x, ids, weights)
        shared = self.shared_expert
        gate_up = shared.gate_up_proj(x)
        g, u = gate_up.chunk(2, dim=-1)
        partial = shared.down_proj.forward_partial(shared.act(g) * u)
        return self.tp.all_reduce(routed + torch.sigmoid(self.shared_expert_gate(x)) * partial)


class Qwen3NextDecoderLayer(nn.Module):
    linear_class: type[GatedDeltaNet] = GatedDeltaNet  # how its checkpoint lays out the projections

    def __init__(self, config: Qwen3NextConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.is_linear = config.linear_layers[layer_idx]
        if self.is_linear:
            self.linear_attn = self.linear_class(
                config.hidden_size,
                config.linear_num_key_heads,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                config.linear_conv_kernel_dim,
                config.rms_norm_eps,
                tp,
            )
        else:
            self.self_attn = GatedAttention(config, tp)
        if config.sparse_layers[layer_idx]:
            self.mlp = SharedExpertMoE(config, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, rope, ctx, cache, state_step) -> torch.Tensor:
        x = self.input_layernorm(h)
        mixer = (
            self.linear_attn(x, state_step, cache) if self.is_linear else self.self_attn(x, rope, ctx, cache)
        )
        h, x = self.post_attention_layernorm.add_forward(h, mixer)
        return h + self.mlp(x)


class Qwen3NextForCausalLM(CausalLM):
    config_class = Qwen3NextConfig
    layer_class = Qwen3NextDecoderLayer
    norm_class = GemmaRMSNorm
    partial_rotary = True
    has_state = True  # linear-attention layers: a state slot per sequence (shard_worker/runner_caches.py)

    @classmethod
    def family_fields(cls, hf) -> dict:
        dense = set(hf.mlp_only_layers or ())
        sparse = tuple(
            i not in dense and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
            for i in range(hf.num_hidden_layers)
        )
        return linear_fields(hf) | {
            "num_experts": hf.num_experts,
            "num_experts_per_tok": hf.num_experts_per_tok,
            "moe_intermediate_size": hf.moe_intermediate_size,
            "shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
            "norm_topk_prob": bool(hf.norm_topk_prob),
            "sparse_layers": sparse,
        }

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        return name.startswith("mtp.")  # the multi-token-prediction layer: not served

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def state_slot_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's state on this rank: every linear layer's conv state (model dtype) and delta-rule
        state (float32)."""
        total = 0
        for layer in self.linear_layers():
            conv, delta = layer.state_shapes()
            total += conv[0] * conv[1] * dtype.itemsize + delta[0] * delta[1] * delta[2] * 4
        return total

    def new_state_caches(self, num_slots: int, dtype, device, host: bool = False) -> list[tuple]:
        """Per linear layer: (conv [slots, C, K - 1], delta [slots, Hv, Dk, Dv] float32). Host ones (swap
        space) uninitialised, device ones zeros (a fresh step zeroes its own rows anyway)."""
        new = torch.empty if host else torch.zeros
        caches = []
        for layer in self.linear_layers():
            conv, delta = layer.state_shapes()
            caches.append(
                (
                    new((num_slots, *conv), dtype=dtype, device="cpu" if host else device),
                    new((num_slots, *delta), dtype=torch.float32, device="cpu" if host else device),
                )
            )
        return caches

    def forward(self, input_ids, positions, ctx, kv_caches, state_step=None, state_caches=None):
        if state_step is None:
            raise ValueError("Qwen3-Next needs the step's state slots (state_step)")
        h = self.embed(input_ids)
        rope = self.rotary[0](positions, h.dtype)
        kv, states = iter(kv_caches), iter(state_caches or ())
        for layer in self.model.layers:
            cache = next(states, None) if layer.is_linear else next(kv)
            h = layer(h, rope, ctx, cache, state_step)
        return self.model.norm(h)


def linear_fields(hf) -> dict:
    """The layer kinds and the linear-attention shapes, as Qwen3-Next and Qwen3.5 spell them."""
    types = list(hf.layer_types)
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"layer_types {unknown[0]!r} is not supported; supported: {LAYER_KINDS}")
    if len(types) != hf.num_hidden_layers or "full_attention" not in types:
        raise ValueError(
            f"layer_types {types} must give each of {hf.num_hidden_layers} layers a kind, "
            "one of them full_attention"
        )
    return {
        "linear_layers": tuple(t == "linear_attention" for t in types),
        "linear_num_key_heads": hf.linear_num_key_heads,
        "linear_num_value_heads": hf.linear_num_value_heads,
        "linear_key_head_dim": hf.linear_key_head_dim,
        "linear_value_head_dim": hf.linear_value_head_dim,
        "linear_conv_kernel_dim": hf.linear_conv_kernel_dim,
    }
