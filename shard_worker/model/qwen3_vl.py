"""Qwen3-VL's language model (Qwen3VLForConditionalGeneration): Qwen3's decoder (q/k norms, no biases)
with M-RoPE whose frequencies take t, h, w in turn (interleaved mrope_section). A text-only prompt is
served as Qwen3 is (three equal positions are the plain rope). What the family shares with Qwen2.5-VL
(config, names, the tower's tensors left to the tower) is in qwen2_5_vl.py; the tower, with its
deepstack features, in qwen_vl_vision.py. Video is not served.
"""

from __future__ import annotations

import torch

from shard_worker.model.config import NO_WINDOW
from shard_worker.model.qwen2_5_vl import QwenVLForConditionalGeneration
from shard_worker.model.qwen3 import Qwen3DecoderLayer
from shard_worker.model.qwen_vl_vision import Qwen3VLVisionModel


class Qwen3VLForConditionalGeneration(QwenVLForConditionalGeneration):
    layer_class = Qwen3DecoderLayer
    window_rule = NO_WINDOW
    tower_class = Qwen3VLVisionModel
    mrope_interleaved = True
    default_mrope_section = (24, 20, 20)

    @property
    def tower_width(self) -> int:
        """An image token's row in the encoder cache: its embedding, then one deepstack feature per
        deepstack layer (the forward adds the k-th after decoder layer k)."""
        return self.config.hidden_size * (1 + len(self.visual.deepstack_layers))

    def tower_rows(self, out) -> torch.Tensor:
        embeds, deepstack = out
        return torch.cat([embeds, *deepstack], dim=-1)
