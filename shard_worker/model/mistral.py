"""Mistral: Llama's layers, with every layer attending over config.json's sliding_window when it sets
one (Mistral 7B v0.1: 4096; later versions set none)."""

from __future__ import annotations

from shard_worker.model.config import EVERY_LAYER
from shard_worker.model.llama import LlamaDecoderLayer, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    layer_class = LlamaDecoderLayer
    window_rule = EVERY_LAYER
