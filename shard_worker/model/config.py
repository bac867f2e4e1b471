"""The model's shape, parsed once from a checkpoint's configs into one frozen object.

transformers parses config.json (so defaults and legacy field names match what the checkpoint's
authors meant); the forward pass reads only this object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Rope types whose frequencies do not depend on the sequence length, so one table serves every step.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama when attention_bias
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # Rotary inverse frequencies in float32, exactly as transformers computes them for this rope type,
    # and the factor cos/sin are scaled by (yarn's attention factor; 1 otherwise).
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        read_json(Path(model_dir) / "config.json")  # a clear error first: transformers' would not name it
        hf = AutoConfig.from_pretrained(model_dir)
        return cls.from_hf(hf, _generation_eos_ids(model_dir))

    @classmethod
    def from_hf(cls, hf, generation_eos_ids: tuple[int, ...] = ()) -> ModelConfig:
        model_type = hf.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (only silu)")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        inv_freq, attention_scaling = _rope(hf, head_dim)

        max_pos = hf.max_position_embeddings
        # Without a sliding-window kernel, sliding-window models (Mistral v0.1, some Qwen2) are served
        # only up to their window, where full attention and windowed attention agree.
        window = getattr(hf, "sliding_window", None)
        if window and (model_type != "qwen2" or getattr(hf, "use_sliding_window", False)):
            max_pos = min(max_pos, window)

        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=max_pos,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=_merge_ids(_as_ids(getattr(hf, "eos_token_id", None)), generation_eos_ids),
            rope_inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(attention_scaling),
        )


def _rope(hf, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        # Same formula as transformers' default rope (which lives on each model's rotary class).
        dim = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** dim), 1.0
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), attention_scaling


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file; ValueError naming the file when it is missing or unreadable."""
    try:
        content = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--model {path.parent}: no {path.name} there") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:  # not UTF-8, or not JSON
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path}: not a JSON object")
    return content


def _generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return ()
    read_json(path)
    return _as_ids(GenerationConfig.from_pretrained(model_dir).eos_token_id)


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _merge_ids(*groups: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for g in groups for i in g))
