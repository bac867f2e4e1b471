"""Multi-LoRA serving on the worker: the adapters given at start (--lora-modules), each in a slot of
every adapted layer's stacked weights (layers.py), and the step's rows per slot (LoRABatch).

A sequence names its adapter (SequenceInit.lora_name; empty: the base model); the worker keeps its slot,
and the runner scopes each forward with the step's LoRABatch."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from shard_worker.model.lora.adapters import parse_lora_modules, place_adapter, read_adapter
from shard_worker.model.lora.layers import LoRABatch, LoRALinearMethod, lora_batch, stack_layer

__all__ = ["LoRAAdapters", "LoRABatch", "lora_batch", "lora_slot", "step_lora_batch"]

log = logging.getLogger("tpserve.shard_worker")


class LoRAAdapters:
    """The adapters this rank serves, by name, and their slots."""

    def __init__(self, model: nn.Module, modules, max_rank: int, dtype: torch.dtype, device):
        """modules: --lora-modules entries (NAME=PATH). Reads each adapter, checks it against the model
        and wraps every layer some adapter adapts; ValueError of one line for a refused adapter."""
        self.max_rank = max_rank
        self.device = device
        adapters = [read_adapter(n, p, max_rank, dtype) for n, p in parse_lora_modules(modules)]
        self.slots = {a.name: slot for slot, a in enumerate(adapters)}
        placed = [place_adapter(a, model) for a in adapters]
        layers = dict(model.named_modules())
        adapted = sorted({name for p in placed for name in p})
        for name in adapted:
            layer = layers[name]
            a, b = stack_layer(layer, [p.get(name, {}) for p in placed], max_rank, dtype, device)
            layer.quant_method = LoRALinearMethod(layer.quant_method, a, b)
        nbytes = sum(
            m.quant_method.lora_a.nbytes + m.quant_method.lora_b.nbytes
            for m in model.modules()
            if isinstance(getattr(m, "quant_method", None), LoRALinearMethod)
        )
        log.info("%d LoRA adapters on %d layers, %.1f MiB", len(adapters), len(adapted), nbytes / 2**20)

    def slot(self, name: str) -> int:
        """The slot of an adapter by name; -1 for "" (the base model); KeyError naming an unknown one."""
        if not name:
            return -1
        if name not in self.slots:
            raise KeyError(f"LoRA adapter {name!r} is not loaded on this worker")
        return self.slots[name]

    def batch(self, seq_slots: np.ndarray, query_lens: np.ndarray) -> LoRABatch | None:
        return LoRABatch.build(seq_slots, query_lens, len(self.slots), self.device)


def lora_slot(lora: LoRAAdapters | None, name: str) -> int:
    """A sequence's slot (-1: the base model); KeyError naming an adapter not served."""
    if lora is None:
        if name:
            raise KeyError(f"LoRA adapter {name!r} asked of a worker started without --enable-lora")
        return -1
    return lora.slot(name)


def step_lora_batch(lora: LoRAAdapters | None, inputs) -> LoRABatch | None:
    """The step's rows per adapter (None: no adapter in it, or a step of no real sequences)."""
    if lora is None or inputs.sequences is None:
        return None
    seqs = inputs.sequences
    slots = np.fromiter((s.lora_slot for s in seqs), dtype=np.int64, count=len(seqs))
    return lora.batch(slots, inputs.query_lens)
