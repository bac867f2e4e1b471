"""Fills a model shard from a checkpoint's safetensors files, reading only this rank's slices.

Checkpoint names map onto parameter names through the model class's `packed_modules_mapping` (a name
piece such as `q_proj` becomes `qkv_proj`, part 0), and expert tensors (`experts.<e>.<proj>.weight`) onto
the stacked expert parameter `experts.<proj>`, part (e, its part). Every parameter part must be filled
exactly once and every checkpoint tensor must fill one: either failure is a ValueError naming a tensor.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shard_worker.attention.layer import Attention
from shard_worker.model.config import ModelConfig, read_json

log = logging.getLogger("tpserve.shard_worker")

# Checkpoint tensors with no parameter behind them (old checkpoints saved rotary buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
KV_SCALES = (".k_scale", ".v_scale")
# A sharded checkpoint's map from tensor name to the file that holds it.
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    tp,
    load_format: str = "auto",
    check=None,
    linear_dtype: torch.dtype | None = None,
    prepack_linear: bool = True,
    quantization: str | None = None,
    prompts_only: bool = False,
):
    """(ModelConfig, this rank's shard of the model) for a checkpoint directory, built on the device in
    the dtype, in eval mode. load_format "auto" reads the checkpoint's weights; "dummy" fills them with
    small random values from config.json alone (vLLM's name), for benchmarks at real shapes. check(model)
    runs before the weights load, so that a refusal does not wait for them.

    Each linear layer's method (shard_worker/model/quant) comes from config.json's quantization_config,
    or --quantization (online int8 / fp8); layers left unquantized hold their weights in linear_dtype
    (if not dtype) and, with prepack_linear on CPU, in our kernel's layout or oneDNN's (quant/
    unquantized.py); prompts_only (served for pooling: no decode step): oneDNN's, whose products win on a
    prompt's rows, where ours is for the few rows of a decode step."""
    from shard_worker.model.quant import select_quant_config
    from shard_worker.model.quant.base import deferred_weights
    from shard_worker.model.quant.unquantized import UnquantizedLinearMethod
    from shard_worker.model.registry import model_class

    config = ModelConfig.from_pretrained(model_dir)
    cast = linear_dtype if linear_dtype is not None and linear_dtype != dtype else None
    unquantized = UnquantizedLinearMethod(cast, prepack_linear and device.type == "cpu", not prompts_only)
    raw = read_json(Path(model_dir) / "config.json").get("quantization_config")
    try:
        quant = select_quant_config(raw, quantization, unquantized)
    except ValueError as e:
        raise ValueError(f"{Path(model_dir) / 'config.json'}: {e}") from None
    gguf = quant if quant.name == "gguf" else None
    if gguf is not None:  # the HF names of the file's tensors, which decide each layer's method
        from transformers import AutoConfig

        from shard_worker.model.quant.gguf import hf_names

        mapping, processor = hf_names(gguf, AutoConfig.from_pretrained(model_dir))
        gguf.names = {hf: name for name, hf in mapping.items()}
    with torch.device(device), _default_dtype(dtype):
        with deferred_weights():
            model = model_class(config.architecture)(config, tp)
        bind_methods(model, quant)
    # x is in the model's dtype: a bfloat16 copy of a float32 model's weights would never be read.
    both = _both_layouts(model) if dtype == torch.bfloat16 and cast is None else None
    if check is not None:
        check(model)
    if load_format == "dummy":
        init_dummy_weights(model)
        process_weights(model)
    elif gguf is not None:
        from shard_worker.model.quant.gguf import (
            GGUFInt4Method,
            GGUFInt8Method,
            gguf_tensors,
            keep_embeddings,
        )

        keep_embeddings(model, gguf)
        kept = {
            name: module.quant_method
            for prefix, module in _method_modules(model)
            if isinstance(module.quant_method, GGUFInt4Method | GGUFInt8Method)
            for name in checkpoint_module_names(prefix, model.packed_modules_mapping)
        }
        tensors = (
            (Path(gguf.file).name, name, tensor)
            for name, tensor in gguf_tensors(gguf, mapping, processor, dtype, kept)
        )
        fill_weights(model, tensors, gguf.file, config.tie_word_embeddings)
    else:
        load_weights(model, model_dir, config.tie_word_embeddings)
    if both is not None:
        log.info(both)
    return config, model.eval()


def bind_methods(model: nn.Module, quant) -> None:
    """Gives every linear layer and expert set its method, now that their names are known (an ignore
    list names checkpoint modules: q_proj, not our merged qkv_proj). MoE routers and a tied LM head
    always take the unquantized method; routers are never cast (their logits pick experts)."""
    from shard_worker.model.layers.embedding import ParallelLMHead
    from shard_worker.model.layers.linear import LinearBase, ReplicatedLinear
    from shard_worker.model.layers.moe import FusedMoE
    from shard_worker.model.quant.unquantized import UnquantizedLinearMethod

    for prefix, module in model.named_modules():
        if isinstance(module, FusedMoE):
            module.set_method(quant.expert_method(module, prefix))
        elif isinstance(module, ReplicatedLinear):
            u = quant.unquantized
            module.set_method(UnquantizedLinearMethod(None, u.prepack, u.own_kernel))
        elif isinstance(module, ParallelLMHead) and module.tied_to is not None:
            module.set_method(quant.unquantized)
        elif isinstance(module, LinearBase):
            names = checkpoint_module_names(prefix, model.packed_modules_mapping)
            module.set_method(quant.linear_method(module, prefix, names))


def _both_layouts(model: nn.Module) -> str | None:
    """On a CPU with AMX, the bfloat16 model's linear weights held for our kernel are also held in
    oneDNN's layout when the copy fits (quant/unquantized.py: both_layouts_fit): products of 12+ rows then
    run on AMX tiles. Returns what to log once the weights are in (None: no such CPU or layer)."""
    from shard_worker.model.quant import cpu_linear
    from shard_worker.model.quant.unquantized import UnquantizedLinearMethod, both_layouts_fit

    ours = [
        (module, module.quant_method)
        for _, module in _method_modules(model)
        if isinstance(module.quant_method, UnquantizedLinearMethod)
        and module.quant_method.prepack
        and module.quant_method.own_kernel
        and module.weight.device.type == "cpu"
    ]
    if not ours or not cpu_linear.available(torch.bfloat16) or not cpu_linear.amx_bf16():
        return None
    nbytes = sum(module.weight.numel() * 2 for module, _ in ours)
    fit = both_layouts_fit(nbytes)
    for _, method in ours:
        method.both_layouts = fit
    held = "held" if fit else "not held (over the share of available memory it may take)"
    gb = nbytes / 1e9
    return f"AMX: bfloat16 linear weights {held} in oneDNN's layout too ({gb:.2f} GB; 12+ rows a product)"


def checkpoint_module_names(prefix: str, mapping: dict) -> list[str]:
    """The checkpoint modules a layer holds: qkv_proj's q_proj, k_proj, v_proj; a layer not merged, its
    own name."""
    head, _, last = prefix.rpartition(".")
    pieces = sorted((index, piece) for piece, (merged, index) in mapping.items() if merged == last)
    return [f"{head}.{piece}" if head else piece for _, piece in pieces] or [prefix]


def _method_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if getattr(m, "quant_method", None) is not None]


def process_weights(model: nn.Module, done: set[str] | None = None) -> None:
    """Runs each layer's process_weights_after_loading once (those not in done)."""
    for name, module in _method_modules(model):
        if done is None or name not in done:
            module.quant_method.process_weights_after_loading(module)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created with the target dtype directly, so a large model is never materialised in
    # float32 first; scoped to construction.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Small random weights where they are (on the device), norms at one: a forward of the right shape
    and cost, producing finite logits, with no checkpoint read."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif getattr(param, "dummy_value", None) is not None:  # a shape record (compressed-tensors)
            param.copy_(param.dummy_value)
        elif param.dtype.is_floating_point and param.element_size() > 1:
            param.uniform_(-0.05, 0.05, generator=generator)
        elif param.dtype.is_floating_point:  # float8: drawn in float32, rounded
            values = torch.empty(param.shape, device=param.device).uniform_(-0.05, 0.05, generator=generator)
            param.copy_(values)
        else:  # packed integers: any bits are a valid value
            raw = param.view(torch.uint8)
            bits = torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=raw.device, generator=generator)
            raw.copy_(bits)


def load_weights(model: nn.Module, model_dir: str | Path, tie_word_embeddings: bool) -> None:
    """Copies each parameter's shard in through its weight_loader (or whole, for replicated ones).

    Raises ValueError naming the first parameter the checkpoint does not provide, or the file it cannot
    read.
    """
    fill_weights(model, _safetensors_sources(checkpoint_files(model_dir)), model_dir, tie_word_embeddings)


def _safetensors_sources(files: list[Path]):
    for file in files:
        with _open(file) as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                yield file.name, ckpt_name, f.get_slice(ckpt_name)


def fill_weights(model: nn.Module, tensors, model_dir, tie_word_embeddings: bool) -> None:
    """load_weights' work for any stream of (file name, checkpoint name, tensor or slice)."""
    mapping = model.packed_modules_mapping
    params = dict(model.named_parameters(remove_duplicate=False))
    # Each (parameter, part) must be filled exactly once; a merged parameter has one entry per part.
    expected = set()
    # A family's part that loads its own tensors (a vision encoder, replicated and read whole):
    # rename_checkpoint_tensor gives our name, take_checkpoint_tensor keeps what is its own, and
    # finish_loading fills that part (naming what is missing).
    self_loaded = getattr(model, "self_loaded_prefix", None)
    rename = getattr(model, "rename_checkpoint_tensor", lambda name: name)
    for name, param in params.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        if self_loaded and name.startswith(self_loaded):
            continue
        expected.update((name, p) for p in getattr(param, "checkpoint_parts", (None,)))
    loaded = set()
    # Each layer is processed (cast, quantized, packed) as soon as its last part is filled, so that an
    # online quantization holds one layer in full precision at a time, not the model.
    owners = {}
    for prefix, module in _method_modules(model):
        for pname, _ in module.named_parameters(recurse=False):
            owners[f"{prefix}.{pname}" if prefix else pname] = prefix
    waiting: dict[str, set] = {}
    for key in expected:
        if key[0] in owners:
            waiting.setdefault(owners[key[0]], set()).add(key)
    modules = dict(_method_modules(model))
    processed: set[str] = set()
    # A family's tensors it has no use for (an encoder's pooler when served for embeddings).
    ignores = getattr(model, "ignores_checkpoint_tensor", lambda name: False)
    for file_name, ckpt_name, source in tensors:
        ckpt_name = rename(ckpt_name)
        if ckpt_name.endswith(IGNORED_SUFFIXES) or ignores(ckpt_name):
            continue
        if self_loaded and model.take_checkpoint_tensor(ckpt_name, source):
            continue
        if tie_word_embeddings and ckpt_name == "lm_head.weight":
            continue  # shared with the embedding, which is loaded from its own tensor
        if ckpt_name.endswith(KV_SCALES):
            _load_kv_scale(model, ckpt_name, source[...], file_name)  # [...]: a scalar too
            continue
        name, part = param_name(ckpt_name, mapping)
        if name not in params:
            raise ValueError(f"{file_name}: tensor {ckpt_name} matches no parameter of the model")
        param = params[name]
        parts = getattr(param, "checkpoint_parts", (None,))
        if part is None and len(parts) > 1:
            part_keys = parts  # a fused tensor: all of the parameter's parts at once
        elif part in parts:
            part_keys = (part,)
        else:  # an expert beyond num_experts, say
            raise ValueError(f"{file_name}: tensor {ckpt_name} matches no part of the model's {name}")
        if loaded & {(name, p) for p in part_keys}:
            raise ValueError(f"{file_name}: tensor {ckpt_name} fills {name} a second time")
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is not None:
                loader(param, source, part)
            else:
                _load_whole(param, source, ckpt_name)
        loaded.update((name, p) for p in part_keys)
        owner = owners.get(name)
        if owner is not None and not waiting[owner] - loaded:
            modules[owner].quant_method.process_weights_after_loading(modules[owner])
            processed.add(owner)
    missing = sorted(expected - loaded, key=str)
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} has no tensor {_checkpoint_name(*missing[0], mapping)} "
            f"({len(missing)} missing in all)"
        )
    if self_loaded:
        model.finish_loading()
    process_weights(model, processed)  # a tied LM head (filled with the embedding), and the rest


def _load_kv_scale(model: nn.Module, ckpt_name: str, tensor: torch.Tensor, file: str) -> None:
    """A layer's fp8 KV scale (vLLM's checkpoint names: `...self_attn.k_scale`, `...self_attn.v_scale`),
    a scalar for the layer's every head, set on its Attention module."""
    prefix, attr = ckpt_name.rsplit(".", 1)
    modules = dict(model.named_modules())
    layer = modules.get(prefix + ".attn")
    if not isinstance(layer, Attention) or tensor.numel() != 1:
        raise ValueError(f"{file}: tensor {ckpt_name} is not one layer's scalar KV scale")
    setattr(layer, attr, float(tensor.float()))


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The files that hold the weights: those the index names when there is one, else every *.safetensors.

    The index decides because a directory may hold files that are not part of the checkpoint (some
    repositories ship a consolidated copy beside the shards; an interrupted download leaves a partial one).
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map in it")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.exists():
                raise ValueError(f"{index} names {file.name}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model {model_dir}: no *.safetensors files there")
    return files


def _open(file: Path):
    """safe_open, with a truncated or corrupt file (its header does not cover it) a ValueError naming it."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def param_name(ckpt_name: str, mapping: dict) -> tuple[str, object]:
    """(our parameter's name, the part this tensor fills: None for the whole parameter)."""
    pieces = ckpt_name.split(".")
    # experts.<e>.<proj>.weight -> experts.<proj as mapped>, part (e, the mapped part).
    if len(pieces) >= 4 and pieces[-4] == "experts" and pieces[-3].isdigit() and pieces[-1] == "weight":
        merged, index = mapping.get(pieces[-2], (pieces[-2], None))
        return ".".join([*pieces[:-3], merged]), (int(pieces[-3]), index)
    for i, piece in enumerate(pieces):
        if piece in mapping:
            merged, index = mapping[piece]
            return ".".join([*pieces[:i], merged, *pieces[i + 1 :]]), index
    return ckpt_name, None


def _checkpoint_name(name: str, part, mapping: dict) -> str:
    """The checkpoint tensor that would fill this part of a parameter (param_name's inverse); a part
    the mapping does not name comes from a fused tensor, named like the parameter."""
    if isinstance(part, tuple):
        expert, part = part
        prefix, _, proj = name.rpartition(".")
        name = f"{prefix}.{expert}.{proj}.weight"
    for ckpt_piece, (merged, index) in mapping.items():
        if index == part and f".{merged}." in name:
            return name.replace(f".{merged}.", f".{ckpt_piece}.")
    return name


def _load_whole(param: nn.Parameter, source, ckpt_name: str) -> None:
    tensor = source[:]
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
        )
    param.data.copy_(tensor)
