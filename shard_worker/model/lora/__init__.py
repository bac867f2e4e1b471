"""Multi-LoRA serving on the worker: the adapters this rank serves by name (--lora-modules at start, and
LoadLoRAAdapter while serving), read into a host cache of --max-cpu-loras (cache.py: the least recently
used evicted), and copied into one of --max-loras device slots of every adaptable layer's stacked
weights (layers.py) when a step uses it. An evicted adapter is read again off the step path: the
scheduler holds a request on it until every rank has prefetched it (fetch/keep, PrefetchLoRAAdapter).
Only if it was evicted again since does a step read it; and an adapter whose files no longer read
(AdapterUnreadable) fails its requests, never the rank: its rows run on the base model and the step
reports it (take_errors), and one named in --lora-modules is served unreadable until its files return.

Every layer an adapter may adapt (q/k/v/o, gate/up/down: adapters.TARGET_MODULES) is wrapped at start,
so an adapter loaded later may adapt any of them; a layer skips the product in a step whose adapters
leave it alone. A sequence names its adapter (SequenceInit.lora_name; empty: the base model), and the
runner scopes each forward with the step's LoRABatch (step_lora_batch)."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from shard_worker.model.lora.adapters import (
    TARGET_MODULES,
    AdapterUnreadable,
    parse_lora_modules,
    place_adapter,
    read_adapter,
)
from shard_worker.model.lora.cache import DeviceSlots, HostCache
from shard_worker.model.lora.layers import LoRABatch, LoRALinearMethod, lora_batch, stack_layer

__all__ = ["LoRAAdapters", "LoRABatch", "check_lora", "lora_batch", "step_lora_batch"]

log = logging.getLogger("tpserve.shard_worker")


def adaptable(name: str, layer: nn.Module, mapping: dict) -> bool:
    """Whether an adapter may adapt this layer: a linear layer (not an expert set) made of target
    projections (a merged one through the family's packed_modules_mapping)."""
    if not hasattr(layer, "output_sizes") or ".experts" in name:
        return False
    last = name.rsplit(".", 1)[-1]
    sources = {piece for piece, (merged, _) in mapping.items() if merged == last} | {last}
    return bool(sources & set(TARGET_MODULES))


class LoRAAdapters:
    """The adapters this rank serves: their paths by name, the host cache and the device slots."""

    def __init__(
        self, model: nn.Module, modules, max_rank: int, dtype, device, max_loras: int = 4, max_cpu_loras=0
    ):
        """modules: --lora-modules entries (NAME=PATH), each read and checked now (ValueError of one line
        for a refused one). max_cpu_loras: 0 for max_loras (vLLM's default)."""
        self.model, self.max_rank, self.dtype, self.device = model, max_rank, dtype, device
        mapping = model.packed_modules_mapping
        self.methods: dict[str, LoRALinearMethod] = {}
        for name, layer in model.named_modules():
            if adaptable(name, layer, mapping):
                base = layer.quant_method
                base = base.base if isinstance(base, LoRALinearMethod) else base  # one wrapper at most
                a, b = stack_layer(layer, [{}] * max_loras, max_rank, dtype, device)
                layer.quant_method = LoRALinearMethod(base, a, b, [False] * max_loras)
                self.methods[name] = layer.quant_method
        self.layers = {name: layer for name, layer in model.named_modules() if name in self.methods}
        self.paths: dict[str, str] = {}
        self.host = HostCache(max_cpu_loras or max_loras)
        self.slots = DeviceSlots(max_loras)
        self._errors: list[tuple[str, str]] = []  # this step's adapters that did not read
        for name, path in parse_lora_modules(modules):
            try:
                self.install(name, path, self.read(name, path))
            except AdapterUnreadable as e:  # gone since the first start: the rank still (re)starts
                log.error("%s; its requests fail with NOT_FOUND until its files return", e)
                self.paths[name] = str(path)
        nbytes = sum(m.lora_a.nbytes + m.lora_b.nbytes for m in self.methods.values())
        log.info(
            "LoRA: %d adapters served, %d on the host (--max-cpu-loras %d), %d device slots on %d "
            "layers, %.1f MiB",
            len(self.paths),
            len(self.host),
            self.host.capacity,
            max_loras,
            len(self.methods),
            nbytes / 2**20,
        )

    def read(self, name: str, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's weights on the host, cut to this rank's shard of each layer it adapts: {layer:
        (A [parts * R, in_local], B [out_local, parts * R])}. ValueError of one line when refused."""
        placed = place_adapter(read_adapter(name, path, self.max_rank, self.dtype), self.model)
        weights = {}
        for layer_name, pairs in placed.items():
            if layer_name not in self.layers:
                raise ValueError(f"LoRA adapter {name!r}: {layer_name} is not a layer adapters may adapt")
            a, b = stack_layer(self.layers[layer_name], [pairs], self.max_rank, self.dtype, "cpu")
            weights[layer_name] = (a[0], b[0])
        return weights

    def install(self, name: str, path: str, weights) -> None:
        """Serves weights (read()) as adapter `name`, replacing one of that name."""
        self.remove(name)
        self.paths[name] = str(path)
        for evicted in self.host.put(name, weights):
            self.slots.drop(evicted)

    def remove(self, name: str) -> bool:
        """Forgets an adapter; whether it was served."""
        self.host.pop(name)
        self.slots.drop(name)
        return self.paths.pop(name, None) is not None

    def fetch(self, name: str):
        """Prefetch, first half (no lock: any thread): the weights of a served adapter that is not on
        the host, read from its path; None when it is there. KeyError for a name not served,
        AdapterUnreadable when its files no longer read."""
        self.check(name)
        if not name or name in self.host:
            return None
        path = self.paths[name]
        return path, self.read(name, path)

    def keep(self, name: str, fetched) -> None:
        """Prefetch, second half (between steps): the weights fetch() read go on the host, unless the
        adapter was unloaded or replaced meanwhile."""
        path, weights = fetched
        if self.paths.get(name) == path and name not in self.host:
            for evicted in self.host.put(name, weights):
                self.slots.drop(evicted)

    def take_errors(self) -> list[tuple[str, str]]:
        """(adapter, why) for each adapter the last step could not read."""
        errors, self._errors = self._errors, []
        return errors

    def check(self, name: str) -> None:
        """KeyError naming an adapter this rank does not serve ("" is the base model)."""
        if name and name not in self.paths:
            raise KeyError(f"LoRA adapter {name!r} is not loaded on this worker")

    def batch(self, names: list[str], query_lens: np.ndarray) -> LoRABatch | None:
        """The step's rows per device slot, each sequence's adapter (names, "" for the base model) put
        on a slot first; None when no sequence has one."""
        wanted = [n for n in dict.fromkeys(names) if n]
        for name in list(wanted):
            if self.host.get(name) is None:  # evicted again since its prefetch: read on the step path
                try:
                    weights = self.read(name, self.paths[name])
                except AdapterUnreadable as e:  # its rows run on the base model; its requests fail
                    log.error("%s: its requests fail", e)
                    self._errors.append((name, str(e)))
                    wanted.remove(name)
                    continue
                log.warning("LoRA adapter %r read on the step path (evicted since its prefetch)", name)
                for evicted in self.host.put(name, weights, keep=wanted):
                    self.slots.drop(evicted)
        if not wanted:
            return None
        slot_of, writes = self.slots.assign(wanted)
        for slot, name in writes:
            self._write(slot, self.host.get(name))
        seq_slots = np.fromiter((slot_of.get(n, -1) for n in names), dtype=np.int64, count=len(names))
        return LoRABatch.build(seq_slots, query_lens, self.slots.count, self.device)

    def _write(self, slot: int, weights) -> None:
        """Puts one adapter's weights in every layer's device slot (zeros where it leaves a layer)."""
        for name, method in self.methods.items():
            pair = weights.get(name)
            if pair is not None:
                method.lora_a[slot].copy_(pair[0])
                method.lora_b[slot].copy_(pair[1])
            elif method.occupied[slot]:
                method.lora_a[slot].zero_()
                method.lora_b[slot].zero_()
            method.occupied[slot] = pair is not None


def check_lora(lora: LoRAAdapters | None, name: str) -> None:
    """KeyError naming an adapter this rank does not serve ("" is the base model)."""
    if lora is None:
        if name:
            raise KeyError(f"LoRA adapter {name!r} asked of a worker started without --enable-lora")
        return
    lora.check(name)


def step_lora_batch(lora: LoRAAdapters | None, inputs) -> LoRABatch | None:
    """The step's rows per adapter (None: no adapter in it, or a step of no real sequences)."""
    if lora is None or inputs.sequences is None:
        return None
    return lora.batch([s.lora_name for s in inputs.sequences], inputs.query_lens)
