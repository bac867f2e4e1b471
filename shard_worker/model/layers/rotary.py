"""Rotary position embeddings, one variant per distinct rope of a model (Gemma 3: local and global).

A RotarySpec is what config parsing derives from config.json: the inverse frequencies in float32, exactly
as transformers computes them for the rope type (default, linear, llama3, yarn), and the factor cos/sin
are scaled by (yarn's attention factor; 1 otherwise). Layers that share a spec share the step's cos/sin:
the model computes them once per distinct spec per step, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Rope types whose frequencies do not depend on the sequence length, so one spec serves every step.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RotarySpec:
    inv_freq: tuple[float, ...]
    attention_scaling: float


def rotary_spec(
    hf, head_dim: int, params: dict, layer_type: str | None = None, partial: bool = False
) -> RotarySpec:
    """The spec of one rope: `params` is its rope_parameters dict (the whole dict, or the entry for
    layer_type when the family gives each layer type its own). partial: the family rotates only the first
    partial_rotary_factor of each head (Qwen3-Next; default rope only: len(inv_freq) says how much).
    ValueError names what is not served."""
    where = f"rope_parameters[{layer_type!r}]" if layer_type else "rope_parameters"
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"{where}.rope_type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}")
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0 and not (partial and rope_type == "default"):
        raise ValueError(f"{where}.partial_rotary_factor {factor} is not supported (only 1)")
    if rope_type == "default":
        # transformers' default rope, which lives on each model's rotary class rather than in the table.
        dim = int(head_dim * factor)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return RotarySpec(tuple((1.0 / (params["rope_theta"] ** exponent)).tolist()), 1.0)
    extra = {"layer_type": layer_type} if layer_type else {}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **extra)
    return RotarySpec(tuple(inv_freq.float().tolist()), float(attention_scaling))


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, in float32 as transformers computes them (rather than a table over
    every position, which is large for long-context models)."""

    def __init__(self, spec: RotarySpec):
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor(spec.inv_freq, dtype=torch.float32), persistent=False)
        self.scale = spec.attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin for the step's positions (broadcast over heads)."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scale, emb.sin() * self.scale
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.shape[-1] < x.shape[-1]:  # partial rotary: the rest of each head passes unrotated
        rot = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
