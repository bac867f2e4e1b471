"""Rotary position embeddings, one variant per distinct rope of a model (Gemma 3: local and global).

A RotarySpec is what config parsing derives from config.json: the inverse frequencies in float32, exactly
as transformers computes them for the rope type (default, linear, llama3, yarn), and the factor cos/sin
are scaled by (yarn's attention factor; 1 otherwise). YaRN is ours (yarn_rope) rather than transformers'
table: its rotary width is an argument, since DeepSeek-V3 rotates only qk_rope_head_dim of each head.

Layers that share a spec share the step's cos/sin: the model computes them once per distinct spec per
step, not once per layer.

M-RoPE (Qwen2.5-VL, Qwen3-VL): each token has three positions (temporal, height, width; equal for text),
and each frequency of the head takes its angle from one of them, as rope_parameters' mrope_section
says: contiguous sections (Qwen2.5-VL: the first 16 frequencies from t, the next 24 from h, the last 24
from w) or interleaved ones (Qwen3-VL: t h w t h w ..., t for the rest). The spec keeps that choice per
frequency (mrope_components); a step's positions are then [3, T] rather than [T], and a text-only step's
[T] positions give exactly the plain rope.
"""

from __future__ import annotations

import math
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
    if rope_type == "yarn":
        inv_freq, attention_scaling = yarn_rope(params, head_dim, hf.max_position_embeddings)
        return RotarySpec(tuple(inv_freq.tolist()), attention_scaling)
    if rope_type == "default":
        # transformers' default rope, which lives on each model's rotary class rather than in the table.
        dim = int(head_dim * factor)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return RotarySpec(tuple((1.0 / (params["rope_theta"] ** exponent)).tolist()), 1.0)
    extra = {"layer_type": layer_type} if layer_type else {}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **extra)
    return RotarySpec(tuple(inv_freq.float().tolist()), float(attention_scaling))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_rope(params: dict, rotary_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: float32 inverse frequencies for `rotary_dim`
    rotated dims (head_dim, or DeepSeek-V3's qk_rope_head_dim) and the factor cos/sin are scaled by.

    Frequencies that turn more than beta_fast times over the original context keep their value
    (extrapolated); those turning fewer than beta_slow times are divided by `factor` (interpolated);
    a linear ramp blends the dims between. `truncate` (default true; gpt-oss sets false) rounds the
    ramp's ends to whole dims. With no `factor`, DeepSeek-V3's convention: max / original positions."""
    base = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:  # the dim whose frequency turns `turns` times over `original`
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one point would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    kept = 1 - ramp  # the share of each dim that keeps its original frequency
    # (1 - kept), not ramp: the same float32 rounding as transformers, so the frequencies are bit-equal.
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(params: dict, scale: float) -> float:
    """DeepSeek-V3's softmax scale under YaRN: head_dim**-0.5 times mscale(factor, mscale_all_dim) squared,
    so the dims that are not rotated get the correction too (transformers' yarn_apply_mscale)."""
    mscale_all_dim = params.get("mscale_all_dim") if params.get("rope_type", "default") != "default" else 0
    if not mscale_all_dim:
        return scale
    return scale * yarn_mscale(params["factor"], mscale_all_dim) ** 2


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
    if cos.shape[-1] < x.shape[-1]:  # partial rotary: the rest of each head passes unrotated
        rot = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
