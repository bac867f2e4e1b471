"""Qwen3.5 (text): Qwen3-Next's layers (Gated DeltaNet between gated full attention, (1 + w) norms,
partial rotary) with a dense MLP in every layer, and the linear attention's projections each their own
tensor (layers/gated_deltanet.py SplitGatedDeltaNet).

The released checkpoints are vision-language (`Qwen3_5ForConditionalGeneration`): the text model's
tensors under `model.language_model.`, read here as the text model's; the vision tower and the
multi-token-prediction layer are not served (their tensors ignored: text in, text out). Their rope is
multimodal (mrope sections over temporal, height and width positions), which for text, where the three
positions are the same, is the plain rope of the first partial_rotary_factor of each head.
"""

from __future__ import annotations

from shard_worker.model.layers.gated_deltanet import SplitGatedDeltaNet
from shard_worker.model.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM, linear_fields

TEXT_PREFIX = "model.language_model."


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    linear_class = SplitGatedDeltaNet


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    layer_class = Qwen3_5DecoderLayer

    @classmethod
    def config_from_hf(cls, hf, architecture: str, eos_ids: tuple[int, ...] = ()):
        return super().config_from_hf(getattr(hf, "text_config", None) or hf, architecture, eos_ids)

    @classmethod
    def family_fields(cls, hf) -> dict:
        dense = (False,) * hf.num_hidden_layers
        experts = dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=False)
        return linear_fields(hf) | experts | {"shared_expert_intermediate_size": 0, "sparse_layers": dense}

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        return name.startswith(("mtp.", "model.visual."))

    def rename_checkpoint_tensor(self, name: str) -> str:
        """A vision-language checkpoint's text tensors under model.language_model. are the text model's."""
        return "model." + name.removeprefix(TEXT_PREFIX) if name.startswith(TEXT_PREFIX) else name


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The released checkpoints, served for text only."""
