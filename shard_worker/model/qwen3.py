"""Qwen3 (dense): Llama's layout with an RMSNorm over each query and key head before rotary, no q/k/v bias
unless attention_bias, and Qwen2's optional sliding layers."""

from __future__ import annotations

from shard_worker.model.base import CausalLM
from shard_worker.model.classifier import sequence_classifier
from shard_worker.model.config import BY_LAYER_TYPE
from shard_worker.model.layers.norm import RMSNorm
from shard_worker.model.llama import LlamaDecoderLayer


class Qwen3DecoderLayer(LlamaDecoderLayer):
    qk_norm = RMSNorm


class Qwen3ForCausalLM(CausalLM):
    layer_class = Qwen3DecoderLayer
    window_rule = BY_LAYER_TYPE


Qwen3ForSequenceClassification = sequence_classifier(Qwen3ForCausalLM)  # Qwen3-Reranker, converted
