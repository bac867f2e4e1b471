"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a built model, and
refusing in one line what is not served.

Each lora_A / lora_B pair names a checkpoint module (`model.layers.3.self_attn.q_proj`), which the model's
`packed_modules_mapping` turns into our layer and its part (qkv_proj, part 0), exactly as the base
checkpoint's tensors are mapped (loader.param_name). The pair is checked against that layer's full
shapes, so an adapter trained on another base is refused before anything is served with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# The projections an adapter may adapt: attention's and the dense MLP's (vLLM's default set).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass
class Adapter:
    """One adapter, read whole on the host: pairs[(our layer name, part)] = (A [r, in], B [out, r] already
    multiplied by the scale)."""

    name: str
    path: str
    rank: int
    scale: float
    pairs: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class AdapterUnreadable(ValueError):
    """The adapter's files are missing or do not read (gone from disk, unreadable, corrupt): its requests
    fail with NOT_FOUND naming it, and the rank goes on (a refusal of what the files hold is a plain
    ValueError: never servable, refused at start and at load)."""


def parse_lora_modules(entries) -> list[tuple[str, str]]:
    """--lora-modules entries `name=path` as (name, path), in order; ValueError naming a bad entry."""
    out: list[tuple[str, str]] = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {entry!r}: expected NAME=PATH")
        if name in {n for n, _ in out}:
            raise ValueError(f"--lora-modules: adapter name {name!r} given twice")
        out.append((name, path))
    return out


def read_adapter(name: str, path: str | Path, max_rank: int, dtype: torch.dtype) -> Adapter:
    """The adapter's config and tensors; ValueError of one line for anything not served."""
    path = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        expected = f"expected {CONFIG_FILE} and {WEIGHTS_FILE} in it (a PEFT directory)"
        raise AdapterUnreadable(f"{where}: {expected}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterUnreadable(f"{where}: {CONFIG_FILE} does not read: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not served; only LORA")
    for key, why in (
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
        ("modules_to_save", "modules_to_save (full copies of base modules)"),
    ):
        if config.get(key):
            raise ValueError(f"{where}: {why} is not served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias {config['bias']!r} is not served; only 'none'")
    rank = int(config["r"])
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = Adapter(name, str(path), rank, scale)
    try:
        with safe_open(path / WEIGHTS_FILE, framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except Exception as e:  # OSError, or safetensors' own error for a truncated or corrupt file
        raise AdapterUnreadable(f"{where}: {WEIGHTS_FILE} does not read: {type(e).__name__}: {e}") from None
    modules = {}
    for key in tensors:
        head, sep, tail = key.rpartition(".lora_")
        if not sep or tail not in ("A.weight", "B.weight"):
            raise ValueError(f"{where}: tensor {key} is not a lora_A / lora_B weight; not served")
        modules.setdefault(head, {})[tail[0]] = tensors[key]
    for module, pair in modules.items():
        last = module.rsplit(".", 1)[-1]
        if ".experts." in module:
            raise ValueError(f"{where}: {module}: LoRA on MoE experts is not served")
        if last not in TARGET_MODULES:
            raise ValueError(
                f"{where}: target module {last!r} is not served; served: {', '.join(TARGET_MODULES)}"
            )
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has no lora_{'B' if 'A' in pair else 'A'} weight")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{where}: {module} has rank {a.shape[0]}/{b.shape[1]}, config says r={rank}")
        adapter.pairs[module.removeprefix("base_model.model.")] = (a.to(dtype), (b * scale).to(dtype))
    if not adapter.pairs:
        raise ValueError(f"{where}: no lora_A / lora_B weights in {WEIGHTS_FILE}")
    return adapter


def place_adapter(adapter: Adapter, model: nn.Module) -> dict[str, dict[int, tuple]]:
    """Each adapted layer's pairs by part: {our layer name: {part index: (A, B)}}, checked against the
    layer's full shapes (ValueError naming the module: an adapter of another base model)."""
    from shard_worker.model.loader import param_name

    layers = dict(model.named_modules())
    placed: dict[str, dict[int, tuple]] = {}
    for module, (a, b) in adapter.pairs.items():
        name, part = param_name(f"{module}.weight", model.packed_modules_mapping)
        layer = layers.get(name.removesuffix(".weight"))
        where = f"LoRA adapter {adapter.name!r}: {module}"
        if layer is None or not hasattr(layer, "output_sizes"):
            raise ValueError(f"{where} matches no linear layer of the model")
        part = part or 0
        expected = (layer.input_size, layer.output_sizes[part])
        if (a.shape[1], b.shape[0]) != expected:
            raise ValueError(
                f"{where}: adapter maps {a.shape[1]} -> {b.shape[0]} features, the model's layer "
                f"{expected[0]} -> {expected[1]} (an adapter for another base model?)"
            )
        placed.setdefault(name.removesuffix(".weight"), {})[part] = (a, b)
    return placed
