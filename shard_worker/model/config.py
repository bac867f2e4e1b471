"""The model's shape, parsed once from a checkpoint's configs into one frozen object.

transformers parses config.json (so defaults and legacy field names match what the checkpoint's
authors meant); the forward pass reads only this object. ModelConfig holds what every family has; a
family that needs more (experts, Gemma's query scaling) subclasses it, and its model class says how its
fields are read (see shard_worker/model/base.py). A field that would change the maths and is not
implemented is refused here, naming it, so that nothing is ever served wrongly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from shard_worker.model.layers.rotary import RotarySpec, rotary_spec

# What the family's attention does with config.json's sliding_window:
NO_WINDOW = "none"  # nothing (Llama has no such field)
EVERY_LAYER = "every_layer"  # every layer attends over the window (Mistral, Mixtral, Phi-3, Qwen3-MoE)
BY_LAYER_TYPE = "by_layer_type"  # layers whose layer_types entry is sliding_attention (Qwen2/3, Gemma 3)
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # config.json's architectures[0]: the registry's key
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # Per layer: the sliding window (a query at position p sees keys p - w < j <= p) or None, and the
    # rotary embedding it applies.
    sliding_windows: tuple[int | None, ...]
    rotary: tuple[RotarySpec, ...]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """The family's config for this checkpoint (a ModelConfig subclass where the family needs one).
        ValueError naming the file or the field when it is not served."""
        from shard_worker.model.registry import model_class

        path = Path(model_dir) / "config.json"
        raw = read_json(path)  # a clear error first: transformers' would not name the file
        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list) or not architectures:
            raise ValueError(f"{path}: no architectures list, so the model class is unknown")
        eos_ids = _generation_eos_ids(model_dir)
        try:
            family = model_class(architectures[0])
            hf = AutoConfig.from_pretrained(model_dir)
            return family.config_from_hf(hf, architectures[0], eos_ids)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def common_fields(
    hf,
    architecture: str,
    eos_ids: tuple[int, ...],
    window_rule: str,
    rope_by_layer_type: bool = False,
    partial_rotary: bool = False,
) -> dict:
    """ModelConfig's fields as most families spell them in config.json (a family overrides any).
    rope_by_layer_type: rope_parameters holds one rope per layer type (Gemma 3), not one for all.
    partial_rotary: the family rotates part of each head (rotary_spec)."""
    refuse_if_set(hf, "mlp_bias", "attn_logit_softcapping", "final_logit_softcapping")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return dict(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        hidden_act=getattr(hf, "hidden_act", "silu"),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=_merge_ids(_as_ids(getattr(hf, "eos_token_id", None)), eos_ids),
        sliding_windows=layer_windows(hf, window_rule),
        rotary=layer_rotary(hf, head_dim, rope_by_layer_type, partial_rotary),
    )


def layer_rotary(hf, head_dim: int, by_layer_type: bool, partial: bool = False) -> tuple[RotarySpec, ...]:
    params = getattr(hf, "rope_parameters", None) or {}
    if not by_layer_type:
        return (rotary_spec(hf, head_dim, params, partial=partial),) * hf.num_hidden_layers
    types = layer_types(hf)
    specs = {t: rotary_spec(hf, head_dim, params[t], layer_type=t) for t in sorted(set(types))}
    return tuple(specs[t] for t in types)


def layer_windows(hf, rule: str) -> tuple[int | None, ...]:
    num_layers = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if rule == NO_WINDOW or not window:
        return (None,) * num_layers
    if rule == EVERY_LAYER:
        return (int(window),) * num_layers
    types = layer_types(hf)
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def layer_types(hf) -> list[str]:
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown[0]!r} is not supported; supported: {LAYER_TYPES}")
    if len(types) != hf.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {hf.num_hidden_layers} layers")
    return types


def refuse_if_set(hf, *fields: str) -> None:
    """ValueError naming the first of these fields that config.json sets (to anything but None/False/0):
    each changes the maths and is not implemented."""
    for field in fields:
        value = getattr(hf, field, None)
        if value:
            raise ValueError(f"{field}={value!r} is not supported (tpserve does not implement it)")


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
