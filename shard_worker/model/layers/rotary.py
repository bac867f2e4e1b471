"""Rotary position embeddings, one variant per distinct rope of a model (Gemma 3: local and global).

A RotarySpec is what config parsing derives from config.json: the inverse frequencies in float32, exactly
as transformers computes them for the rope type (default, linear, llama3, yarn), and the factor cos/sin
are scaled by (yarn's attention factor; 1 otherwise). Layers that share a spec share the step's cos/sin:
the model computes them once per distinct spec per step, not once per layer.

M-RoPE (Qwen2.5-VL, Qwen3-VL): each token has three positions (temporal, height, width; equal for text),
and each frequency of the head takes its angle from one of them, as rope_parameters' mrope_section
says: contiguous sections (Qwen2.5-VL: the first 16 frequencies from t, the next 24 from h, the last 24
from w) or interleaved ones (Qwen3-VL: t h w t h w ..., t for the rest). The spec keeps that choice per
frequency (mrope_components); a step's positions are then [3, T] rather than [T], and a text-only step's
[T] positions give exactly the plain rope.
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
    # M-RoPE: per frequency, the position component (0 t, 1 h, 2 w) its angle is taken from; None: plain.
    mrope_components: tuple[int, ...] | None = None


def mrope_components(section: list[int], num_freqs: int, interleaved: bool) -> tuple[int, ...]:
    """Which of (t, h, w) each of the num_freqs frequencies rotates by, as transformers recomposes them:
    Qwen2_5_VLRotaryEmbedding (contiguous sections) or Qwen3VLTextRotaryEmbedding (interleaved)."""
    if len(section) != 3 or (sum(section) != num_freqs and not interleaved):
        raise ValueError(f"mrope_section {section} does not split the head's {num_freqs} frequencies in 3")
    if not interleaved:
        return tuple(c for c, n in enumerate(section) for _ in range(n))
    components = [0] * num_freqs
    for c in (1, 2):
        for j in range(c, min(section[c] * 3, num_freqs), 3):
            components[j] = c
    return tuple(components)


def rotary_spec(hf, head_dim: int, params: dict, layer_type: str | None = None) -> RotarySpec:
    """The spec of one rope: `params` is its rope_parameters dict (the whole dict, or the entry for
    layer_type when the family gives each layer type its own). ValueError names what is not served."""
    where = f"rope_parameters[{layer_type!r}]" if layer_type else "rope_parameters"
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"{where}.rope_type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"{where}.partial_rotary_factor {params['partial_rotary_factor']} is not supported (only 1)"
        )
    if rope_type == "default":
        # transformers' default rope, which lives on each model's rotary class rather than in the table.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
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
        components = spec.mrope_components
        self.register_buffer(
            "components",
            None if components is None else torch.tensor(components, dtype=torch.int64),
            persistent=False,
        )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin for the step's positions (broadcast over heads): [T], or M-RoPE's
        [3, T] (t, h, w) with a spec that has mrope_components."""
        if positions.dim() == 2:
            if self.components is None:
                raise ValueError("3-component positions given to a rope without mrope_section")
            # [T, num_freqs]: each frequency's angle from its own component of each token's positions.
            freqs = positions.float().index_select(0, self.components).T * self.inv_freq.unsqueeze(0)
        else:
            freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scale, emb.sin() * self.scale
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
