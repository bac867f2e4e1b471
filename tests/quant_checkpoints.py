"""Small random quantized checkpoints, written the way people write them: a transformers Llama, its
weights quantized by compressed-tensors' own schemes (apply_quantization_config, calculate_qparams) and
compressed to disk by its ModelCompressor, as llmcompressor does at the end of a run.

Shapes: every input feature count a multiple of 256, so group-128 scales split across 2 ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.conftest import TINY

# hidden 256 (q/k/v/gate/up inputs), 4 heads of 64 (o_proj input 256), intermediate 512 (down input).
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
    vocab_size=1024,  # the tiny model's tokenizer
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
LOGIT_STD = 4.0  # peaked next-token distributions: greedy decoding is not decided by near-ties

# name -> (weights args, input activation args or None, format). The schemes llmcompressor's presets
# name W8A16, W8A8 (int8, dynamic per token), W4A16 (group 128, symmetric and asymmetric), FP8_DYNAMIC.
SCHEMES = {
    "w8a16": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), None, "int-quantized"),
    "w8a8": (
        dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
        "int-quantized",
    ),
    "w4a16": (
        dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
        None,
        "pack-quantized",
    ),
    "w4a16_asym": (
        dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128),
        None,
        "pack-quantized",
    ),
    "fp8_channel": (
        dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
        dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
        "float-quantized",
    ),
    "fp8_tensor": (
        dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
        dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
        "float-quantized",
    ),
}


def build_unquantized(out: Path, seed: int = 0, dtype=torch.float32) -> Path:
    """A random Llama of SHAPE with the tiny model's tokenizer, saved as transformers saves it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, initializer_range=0.1)).to(dtype)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, LOGIT_STD / SHAPE["hidden_size"] ** 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, out / name)
    return out


def build_compressed(scheme: str, out: Path, seed: int = 0) -> Path:
    """The SHAPE Llama quantized with `scheme` (lm_head ignored, as llmcompressor's recipes do) and
    saved compressed; config.json gets compressed-tensors' quantization_config."""
    return compress(build_unquantized(out, seed), scheme, out)


def compress(src: Path, scheme: str, out: Path, dtype=torch.float32, group_size: int | None = None) -> Path:
    """The transformers Llama in `src`, loaded in `dtype` ("auto": its config's), quantized with
    `scheme` (group_size replaces a group scheme's) and saved compressed in `out` (which may be
    `src`) with src's tokenizer files."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import LlamaForCausalLM

    weights, activations, fmt = SCHEMES[scheme]
    if group_size is not None and weights["strategy"] == "group":
        weights = {**weights, "group_size": group_size}
    model = LlamaForCausalLM.from_pretrained(src, dtype=dtype)
    group = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=QuantizationArgs(**activations) if activations else None,
    )
    config = QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"], format=fmt)
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _calibrate_weight(module)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out, safe_serialization=True)
    compressor.update_config(str(out))
    _copy_tokenizer(src, out)
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists() and src.resolve() != out.resolve():
            shutil.copy(src / name, out / name)


@torch.no_grad()
def _calibrate_weight(module: torch.nn.Module) -> None:
    """Min-max weight scales (and zero points), what llmcompressor's default observer computes."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight
    if args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:  # group
        g = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
            module.weight_zero_point.shape
        )


def quantization_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())["quantization_config"]


def dequantized_copy(model_dir: Path, out: Path) -> Path:
    """The same model with every quantized weight dequantized to float32 by an independent routine
    (compressed-tensors' own unpack_from_int32, then w = (q - zero) * scale), config.json without its
    quantization_config: what transformers loads as the reference."""
    from compressed_tensors.compressors import unpack_from_int32
    from safetensors.torch import load_file, save_file

    qc = quantization_config(model_dir)
    weights = qc["config_groups"]["group_0"]["weights"]
    tensors = load_file(model_dir / "model.safetensors")
    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_scale")}
    for m in modules:
        scale = tensors.pop(f"{m}.weight_scale").double()
        zero = tensors.pop(f"{m}.weight_zero_point", None)
        if f"{m}.weight_packed" in tensors:
            shape = torch.Size(tensors.pop(f"{m}.weight_shape").tolist())
            q = unpack_from_int32(tensors.pop(f"{m}.weight_packed"), weights["num_bits"], shape).double()
            if zero is not None:
                zshape = torch.Size([shape[0], scale.shape[1]])
                zero = unpack_from_int32(zero, weights["num_bits"], zshape, packed_dim=0).double()
        else:
            q = tensors.pop(f"{m}.weight").double()
        group = q.shape[1] // scale.shape[1] if scale.dim() == 2 else q.shape[1]
        scale = scale.reshape(-1, 1).expand(q.shape[0], -1) if scale.numel() == 1 else scale
        scale, zero = (t.repeat_interleave(group, dim=1) if t is not None else None for t in (scale, zero))
        tensors[f"{m}.weight"] = ((q - (0 if zero is None else zero)) * scale).float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return out


def activation_rounding(model_dir: Path):
    """prepare(model) for tests/reference.hf_greedy: the checkpoint's dynamic input-activation rounding
    (per token, symmetric: int8 round(x / s) * s with s = amax / 127; e4m3 with s = amax / 448) as
    forward pre-hooks on the quantized linear layers; None for weight-only schemes."""
    qc = quantization_config(model_dir)
    act = qc["config_groups"]["group_0"].get("input_activations")
    if act is None:
        return None

    def round_input(module, args):
        x = args[0]
        amax = x.abs().amax(dim=-1, keepdim=True) if act["strategy"] == "token" else x.abs().amax()
        amax = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
        if act["type"] == "int":
            s = amax / 127
            xr = torch.round(x.float() / s).clamp(-127, 127) * s
        else:
            s = amax / 448
            xr = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        return (xr.to(x.dtype),)

    def prepare(model):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name not in qc["ignore"]:
                module.register_forward_pre_hook(round_input)

    return prepare


def offline_quantized(model_dir: Path, out: Path, rule: str) -> Path:
    """The model with each linear layer's weight (not the LM head's) replaced by its quantized and
    dequantized self, by the online rule written out independently: a scale per output row of
    amax / 127 (int8, rounded to nearest) or amax / 448 (e4m3)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    for name, w in tensors.items():
        if "_proj.weight" not in name:
            continue
        if rule == "int8":
            s = w.abs().amax(dim=1, keepdim=True) / 127
            tensors[name] = torch.round(w / s).clamp(-127, 127) * s
        else:
            s = w.abs().amax(dim=1, keepdim=True) / 448
            tensors[name] = (w / s).to(torch.float8_e4m3fn).float() * s
    shutil.copytree(model_dir, out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Layers reading the same input share GPTQ's act order (it comes from that input's statistics).
SAME_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
              "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}  # fmt: skip


def minmax_int4(w: torch.Tensor, g_idx: torch.Tensor, groups: int, symmetric: bool = False):
    """Asymmetric 4-bit min-max per (row, group): q [N, K], scale and zero [N, G] (zero 1..15, which
    GPTQ v1 can store; scale rounded to fp16 as both formats store it). symmetric: GPTQ's `sym`, the
    range +-absmax over 15 steps around a zero of 8."""
    n = w.shape[0]
    scale, zero = torch.empty(n, groups), torch.empty(n, groups)
    q = torch.empty(w.shape, dtype=torch.uint8)
    for j in range(groups):
        cols = (g_idx == j).nonzero().flatten()
        block = w[:, cols]
        lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
        if symmetric:
            hi = torch.maximum(-lo, hi)
            lo = -hi
        s = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        z = torch.full_like(s, 8) if symmetric else torch.round(-lo / s).clamp(1, 15)
        scale[:, j], zero[:, j] = s, z
        q[:, cols] = torch.round(block / s[:, None] + z[:, None]).clamp(0, 15).to(torch.uint8)
    return q, scale, zero


def write_int4(
    src: Path, quantized_dir: Path, fmt: str, group: int, reference_dir: Path | None = None,
    desc_act: bool = False, symmetric: bool = False,
):  # fmt: skip
    """src's linear layers rounded to 4 bits (minmax_int4) and written as an AWQ (`version: gemm`) or
    GPTQ (v1) checkpoint in each format's documented packing (quant/awq.py pack_awq, quant/gptq.py
    pack_gptq); with reference_dir, also the float checkpoint of its dequantized weights. desc_act: a
    random act-order g_idx per layer input, shared by the layers that read it, as GPTQ writes it;
    symmetric: GPTQ's `sym` (zero points all 8)."""
    from safetensors.torch import load_file, save_file

    from shard_worker.model.quant.awq import pack_awq
    from shard_worker.model.quant.gptq import pack_gptq

    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    quantized, reference = {}, dict(tensors)
    gen = torch.Generator().manual_seed(7)
    orders = {}
    for name, w in tensors.items():
        module = name.rsplit(".", 2)
        if len(module) < 3 or module[1] not in LINEARS or module[2] != "weight":
            quantized[name] = w
            continue
        prefix, proj = name[: -len(".weight")], module[1]
        k = w.shape[1]
        g_idx = torch.arange(k) // group
        if desc_act:
            layer_input = name.split(".self_attn")[0].split(".mlp")[0] + SAME_INPUT[proj]
            order = orders.setdefault(layer_input, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // group
        q, scale, zero = minmax_int4(w.double(), g_idx, k // group, symmetric)
        # float32 holds every (q - zero) * scale exactly (a bfloat16 source's dtype would round it).
        reference[name] = ((q.double() - zero[:, g_idx]) * scale[:, g_idx]).float()
        packed = pack_awq(q, scale, zero, group) if fmt == "awq" else pack_gptq(q, scale, zero, group, g_idx)
        quantized.update({f"{prefix}.{key}": value for key, value in packed.items()})
    if fmt == "awq":
        assert not symmetric, "AWQ gemm always has zero points"
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": symmetric,
              "checkpoint_format": "gptq"}  # fmt: skip
    outs = [(quantized_dir, quantized, {"quantization_config": qc})]
    if reference_dir is not None:
        outs.append((reference_dir, reference, {}))
    for out, weights, extra in outs:
        out.mkdir(parents=True)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, **extra}))
        _copy_tokenizer(src, out)
    return quantized_dir, reference_dir
