"""Qwen2.5-VL's language model (Qwen2_5_VLForConditionalGeneration): Qwen2's decoder (q/k/v biases, no o
bias) with M-RoPE, three positions per token (shard_worker/mrope.py) whose frequencies split t/h/w by
rope_parameters' mrope_section (shard_worker/model/layers/rotary.py). A text-only prompt has all three
equal, which is the plain rope: it is served as Qwen2 is. The vision tower is
shard_worker/model/qwen_vl_vision.py, loaded from the same checkpoint's visual.* tensors, which the
language model leaves alone.

The checkpoint's text model is model.language_model.* (transformers 5) or model.* (the published
Qwen2.5-VL files); both load. Video is not served.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shard_worker.model.base import CausalLM
from shard_worker.model.config import BY_LAYER_TYPE, ModelConfig, common_fields
from shard_worker.model.layers.rotary import mrope_components
from shard_worker.model.llama import LlamaDecoderLayer

VISION_PREFIXES = ("visual.", "model.visual.")


@dataclass(frozen=True)
class QwenVLConfig(ModelConfig):
    image_token_id: int
    spatial_merge_size: int  # the tower merges merge x merge patches into one placeholder


class QwenVLForConditionalGeneration(CausalLM):
    """What the Qwen VL families share: the config read from text_config with M-RoPE, and the names."""

    config_class = QwenVLConfig

    def rename_checkpoint_tensor(self, name: str) -> str:
        return (
            "model." + name[len("model.language_model.") :]
            if name.startswith("model.language_model.")
            else name
        )

    mrope_interleaved = False  # Qwen3-VL's frequencies take t, h, w in turn
    default_mrope_section: tuple[int, int, int]  # transformers' when rope_parameters has none

    @classmethod
    def config_from_hf(cls, hf, architecture: str, eos_ids: tuple[int, ...] = ()) -> ModelConfig:
        text = hf.text_config
        fields = common_fields(text, architecture, eos_ids, cls.window_rule) | cls.family_fields(text)
        if fields["hidden_act"] not in cls.activations:
            raise ValueError(
                f"hidden_act {fields['hidden_act']!r} is not supported; supported: {cls.activations}"
            )
        section = list((text.rope_parameters or {}).get("mrope_section") or cls.default_mrope_section)
        components = mrope_components(section, fields["head_dim"] // 2, cls.mrope_interleaved)
        fields["rotary"] = tuple(replace(spec, mrope_components=components) for spec in fields["rotary"])
        fields["tie_word_embeddings"] = bool(getattr(hf, "tie_word_embeddings", False))
        fields["image_token_id"] = hf.image_token_id
        fields["spatial_merge_size"] = hf.vision_config.spatial_merge_size
        return cls.config_class(**fields)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """The vision tower's tensors: its own module loads them (qwen_vl_vision.py)."""
        return name.startswith(VISION_PREFIXES)


class Qwen2_5_VLForConditionalGeneration(QwenVLForConditionalGeneration):
    layer_class = LlamaDecoderLayer
    window_rule = BY_LAYER_TYPE
    default_mrope_section = (16, 24, 24)

    @classmethod
    def family_fields(cls, hf) -> dict:
        return {"qkv_bias": True, "o_bias": False}
