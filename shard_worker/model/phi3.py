"""Phi-3: Llama's layers, every layer over sliding_window when set, and q/k/v and gate/up already fused
in the checkpoint (qkv_proj, gate_up_proj): our merged parameters have the same names, and the loader
hands each fused tensor to its weight loader whole, which takes this rank's rows of each part
(shard_worker/model/layers/linear.py). Phi-3's long-context rope (longrope) and partial rotary are refused
by the rope parsing."""

from __future__ import annotations

from shard_worker.model.base import CausalLM
from shard_worker.model.config import EVERY_LAYER
from shard_worker.model.llama import LlamaDecoderLayer


class Phi3ForCausalLM(CausalLM):
    layer_class = LlamaDecoderLayer
    window_rule = EVERY_LAYER
    packed_modules_mapping = {}  # nothing to merge: the checkpoint's projections are fused already
