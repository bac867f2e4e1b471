"""Qwen2.5-VL's language model (Qwen2_5_VLForConditionalGeneration): Qwen2's decoder (q/k/v biases, no o
bias) with M-RoPE, three positions per token (shard_worker/mrope.py) whose frequencies split t/h/w by
rope_parameters' mrope_section (shard_worker/model/layers/rotary.py). A text-only prompt has all three
equal, which is the plain rope: it is served as Qwen2 is. The vision tower
(shard_worker/model/qwen_vl_vision.py) is a part of the model replicated on every rank, which loads its
visual.* tensors whole itself; its rows replace the placeholders' embeddings (shard_worker/images.py).

The checkpoint's text model is model.language_model.* (transformers 5) or model.* (the published
Qwen2.5-VL files); both load. Video is not served.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shard_worker.model.base import CausalLM
from shard_worker.model.config import BY_LAYER_TYPE, ModelConfig, common_fields
from shard_worker.model.layers.rotary import mrope_components
from shard_worker.model.llama import LlamaDecoderLayer
from shard_worker.model.qwen_vl_vision import Qwen2_5_VisionTransformer
from shard_worker.mrope import MRopePositions, prompt_positions
from shard_worker.parallel import TensorParallel

# Checkpoint prefix -> ours: transformers 5 writes model.language_model.* and model.visual.*, the
# published Qwen2.5-VL files model.* and visual.*.
RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


@dataclass(frozen=True)
class QwenVLConfig(ModelConfig):
    image_token_id: int
    spatial_merge_size: int  # the tower merges merge x merge patches into one placeholder
    # transformers' parse of config.json: the vision tower's shapes (qwen_vl_vision.py).
    hf: Any = field(compare=False, repr=False)


class QwenVLForConditionalGeneration(CausalLM):
    """What the Qwen VL families share: the config read from text_config with M-RoPE, the tower loaded
    from its own tensors, and each prompt's positions.

    The tower's input for an image is the processor's patches for it, shaped [t, h, w, patch values] by
    the router (router/media/render.py), so that the worker reads the grid from the shape. Its output
    for an image is [tokens, hidden] (Qwen3-VL: with the deepstack features beside it, qwen3_vl.py)."""

    config_class = QwenVLConfig
    tower_class: type[torch.nn.Module] = Qwen2_5_VisionTransformer
    self_loaded_prefix = "visual."  # the tower reads its own tensors, whole on every rank
    mrope_interleaved = False  # Qwen3-VL's frequencies take t, h, w in turn
    default_mrope_section: tuple[int, int, int]  # transformers' when rope_parameters has none

    def __init__(self, config: QwenVLConfig, tp: TensorParallel):
        super().__init__(config, tp)
        self.visual = self.tower_class(config.hf.vision_config)
        self._tower_tensors: dict[str, torch.Tensor] = {}

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
        return cls.config_class(**fields, hf=hf)

    def rename_checkpoint_tensor(self, name: str) -> str:
        for old, new in RENAMES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def take_checkpoint_tensor(self, name: str, source) -> bool:
        """The tower's tensors are kept until finish_loading; False for the decoder's."""
        if not name.startswith(self.self_loaded_prefix):
            return False
        self._tower_tensors[name] = source[:]
        return True

    def finish_loading(self) -> None:
        tensors, self._tower_tensors = self._tower_tensors, {}
        self.visual.load(tensors)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, t, h, w, patch values] (images of one grid) -> [N, tokens, hidden]."""
        n, t, h, w, _ = pixel_values.shape
        out = self.visual(pixel_values.reshape(n * t * h * w, -1), [(t, h, w)] * n)
        return self.tower_rows(out).reshape(n, -1, self.tower_width)

    @property
    def tower_width(self) -> int:
        return self.config.hidden_size

    def tower_rows(self, out) -> torch.Tensor:
        return out

    def forward(self, input_ids, positions, ctx, kv_caches, images=None) -> torch.Tensor:
        """CausalLM's, with positions [3, T] when the step holds a prompt with images (the runner builds
        them from each sequence's table), and the encoder's rows written over the placeholders'
        embeddings; Qwen3-VL's deepstack features, beside them in the rows, are added to the
        placeholders' hidden states after the first layers."""
        h = self.embed(input_ids)
        deepstack = ()
        if images is not None:
            rows = images.embeds.to(h.dtype)
            width = self.config.hidden_size
            h = h.index_copy(0, images.rows, rows[:, :width])
            deepstack = rows[:, width:].split(width, dim=-1) if rows.shape[1] > width else ()
        ropes = [rotary(positions, h.dtype) for rotary in self.rotary]
        layers = zip(self.model.layers, self.rotary_of_layer, kv_caches, strict=True)
        for i, (layer, rope, kv_cache) in enumerate(layers):
            h = layer(h, ropes[rope], ctx, kv_cache)
            if i < len(deepstack):
                h = h.index_add(0, images.rows, deepstack[i])
        return self.model.norm(h)

    def prompt_positions(self, token_ids, images) -> MRopePositions | None:
        """A prompt's M-RoPE table (shard_worker/mrope.py), from its images' [t, h, w, ...] pixel shapes;
        None without images (its positions are the plain ones)."""
        if not images:
            return None
        grids = [tuple(int(x) for x in im.pixel_values.shape[:3]) for im in images]
        merge = self.config.spatial_merge_size
        return prompt_positions(token_ids, self.config.image_token_id, grids, merge)


class Qwen2_5_VLForConditionalGeneration(QwenVLForConditionalGeneration):
    layer_class = LlamaDecoderLayer
    window_rule = BY_LAYER_TYPE
    default_mrope_section = (16, 24, 24)

    @classmethod
    def family_fields(cls, hf) -> dict:
        return {"qkv_bias": True, "o_bias": False}
