"""Gemma 3: text only (Gemma3ForCausalLM: the 270M and 1B checkpoints), and with images
(Gemma3ForConditionalGeneration: 4B and up; the encoder is gemma3_vision.py).

Against Llama: (1 + w) RMS norms in float32, on the hidden states and on each query and key head; four
norms per layer (around attention and around the MLP, each output normed before the residual add); the
embedding scaled by sqrt(hidden_size), rounded to the model dtype first as transformers does; gelu-tanh
MLP; attention scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5; and local sliding
layers interleaved with global ones (layer_types), each kind with its own rope (rope_parameters per
layer type: local theta 10k, global 1M with the larger models' linear scaling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shard_worker.model.base import CausalLM
from shard_worker.model.config import BY_LAYER_TYPE, ModelConfig, common_fields, refuse_if_set
from shard_worker.model.layers.mlp import GatedMLP
from shard_worker.model.layers.norm import GemmaRMSNorm
from shard_worker.model.layers.self_attention import SelfAttention
from shard_worker.parallel import TensorParallel


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    query_pre_attn_scalar: float


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_idx: int, tp: TensorParallel):
        super().__init__()
        scale = config.query_pre_attn_scalar**-0.5
        self.self_attn = SelfAttention(config, layer_idx, tp, qk_norm=GemmaRMSNorm, scale=scale)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, h, rope, ctx, kv_cache: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, ctx, kv_cache)
        h, x = self.pre_feedforward_layernorm.add_forward(h, self.post_attention_layernorm(a))
        return h + self.post_feedforward_layernorm(self.mlp(x))


class Gemma3ForCausalLM(CausalLM):
    config_class = Gemma3Config
    layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm
    window_rule = BY_LAYER_TYPE
    rope_by_layer_type = True
    activations = ("gelu_pytorch_tanh",)

    def __init__(self, config: Gemma3Config, tp: TensorParallel):
        super().__init__(config, tp)
        # A float32 scalar cast to the model dtype, as transformers' scaled embedding does.
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer("embed_scale", scale.to(torch.get_default_dtype()), persistent=False)

    @classmethod
    def family_fields(cls, hf) -> dict:
        # EmbeddingGemma's bidirectional attention is not a causal LM's.
        refuse_if_set(hf, "use_bidirectional_attention")
        return {"hidden_act": hf.hidden_activation, "query_pre_attn_scalar": hf.query_pre_attn_scalar}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.embed_scale


@dataclass(frozen=True)
class Gemma3VisionConfig(Gemma3Config):
    image_token_id: int
    # transformers' parse of config.json: the vision tower's and projector's shapes (gemma3_vision.py).
    hf: Any = field(compare=False, repr=False)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 4B and up: the text decoder above, with the SigLIP encoder's soft tokens written over each
    image's placeholder embeddings (after the embedding's scaling, as transformers merges them), and an
    image's placeholders attending to each other both ways in every layer (within a sliding layer's
    window), as transformers' token_type_ids mask does. A text-only prompt runs exactly as
    Gemma3ForCausalLM. The encoder is replicated on every rank (shard_worker/images.py)."""

    config_class = Gemma3VisionConfig
    # The encoder's tensors, loaded whole by the encoder itself (its q_proj is not the decoder's).
    self_loaded_prefix = "encoder."

    def __init__(self, config: Gemma3VisionConfig, tp: TensorParallel):
        from shard_worker.model.gemma3_vision import Gemma3ImageEncoder

        super().__init__(config, tp)
        for layer in self.model.layers:
            layer.self_attn.attn.image_bidirectional = True
        self.encoder = Gemma3ImageEncoder(config.hf)
        self._encoder_tensors: dict[str, torch.Tensor] = {}

    @classmethod
    def config_from_hf(cls, hf, architecture: str, eos_ids: tuple[int, ...] = ()) -> Gemma3VisionConfig:
        text = hf.text_config
        fields = common_fields(text, architecture, eos_ids, cls.window_rule, cls.rope_by_layer_type)
        fields |= cls.family_fields(text)
        # The published checkpoints tie the LM head to the embedding at the top level of config.json.
        fields["tie_word_embeddings"] = bool(
            getattr(hf, "tie_word_embeddings", fields["tie_word_embeddings"])
        )
        eos = getattr(hf, "eos_token_id", None)
        if eos is not None:
            fields["eos_token_ids"] = tuple(dict.fromkeys((*fields["eos_token_ids"], *_ids(eos))))
        if fields["hidden_act"] not in cls.activations:
            raise ValueError(f"hidden_act {fields['hidden_act']!r} is not supported")
        if getattr(hf.vision_config, "vision_use_head", False):
            raise ValueError("vision_config.vision_use_head=True is not supported (Gemma 3 uses the patches)")
        return cls.config_class(**fields, image_token_id=hf.image_token_id, hf=hf)

    def rename_checkpoint_tensor(self, name: str) -> str:
        """Our name for a checkpoint tensor: the published layout (language_model.model.*,
        vision_tower.vision_model.*) and transformers 5's (model.language_model.*, model.vision_tower.*)."""
        for old, new in RENAMES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def take_checkpoint_tensor(self, name: str, source) -> bool:
        """The encoder's tensors (and the SigLIP head's, which Gemma 3 does not use) are kept here until
        finish_loading; False for the decoder's."""
        if name.startswith("encoder.vision_tower.head."):
            return True
        if not name.startswith(self.self_loaded_prefix):
            return False
        self._encoder_tensors[name[len(self.self_loaded_prefix) :]] = source[:]
        return True

    def finish_loading(self) -> None:
        tensors, self._encoder_tensors = self._encoder_tensors, {}
        self.encoder.load(tensors)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, image_size, image_size] -> [N, mm_tokens_per_image, hidden] soft tokens."""
        return self.encoder(pixel_values)


RENAMES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "encoder.vision_tower."),
    ("vision_tower.vision_model.", "encoder.vision_tower."),
    ("model.vision_tower.", "encoder.vision_tower."),
    ("vision_tower.", "encoder.vision_tower."),
    ("model.multi_modal_projector.", "encoder.multi_modal_projector."),
    ("multi_modal_projector.", "encoder.multi_modal_projector."),
)


def _ids(value) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)
