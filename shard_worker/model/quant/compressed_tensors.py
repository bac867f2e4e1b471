"""compressed-tensors checkpoints (llmcompressor's output, vLLM's main format), read from their on-disk
form: config.json's quantization_config names config_groups (targets -> weights / input_activations
args, and a format), an ignore list, and a global format.

Served (per layer: a group's scheme, or unquantized when ignored or targeted by no group):
    int-quantized    int8 weights [N, K], weight_scale [N, 1]: W8A16 (weight-only) and W8A8 (activations
                     int8 per token, dynamic): products.pack_int8 (our CPU kernel, AVX-512 VNNI for
                     W8A8; else kernels.PackedInt8, matmul_dynamic for W8A8)
    pack-quantized   4-bit (group or channel; symmetric, or asymmetric with weight_zero_point) and
                     symmetric 8-bit per channel, eight / four values per int32 (weight_packed), and
                     weight_shape: kernels.PackedInt4 / products.pack_int8
    float-quantized  e4m3 weights, weight_scale per channel [N, 1] or per tensor [1], activations none
                     or dynamic e4m3 (per token or per tensor): torch._scaled_mm on CUDA with fp8
                     (products.fp8_linear: activations e4m3 per token there even when the checkpoint
                     has none, as vLLM's online fp8); else our CPU kernel (products.pack_fp8) or
                     dequantized for the product
Refused in one line: any other format, bit width, strategy, asymmetric 8-bit, static activation scales,
activation ordering with g_idx, KV-cache schemes, sparsity and transforms, and MoE experts.
"""

from __future__ import annotations

import re

import torch

from shard_worker.model.quant import products
from shard_worker.model.quant.base import LinearMethod, QuantConfig, add_param
from shard_worker.model.quant.kernels import PackedInt4

NAME = "compressed-tensors"
LINEAR_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized", "float-quantized")


class CompressedTensorsConfig(QuantConfig):
    name = NAME

    def __init__(self, unquantized: LinearMethod, groups: list, ignore: list[str]):
        super().__init__(unquantized)
        self.groups = groups  # [(targets, method)], in config order
        self.ignore = ignore

    @classmethod
    def from_config(cls, qc: dict, unquantized: LinearMethod) -> CompressedTensorsConfig:
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if qc.get(key):
                raise ValueError(f"{NAME}: {key} is not supported")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"{NAME}: quantization_status {status!r} is not supported (only compressed)")
        groups = []
        for name, group in (qc.get("config_groups") or {}).items():
            fmt = group.get("format") or qc.get("format")
            groups.append((list(group.get("targets") or []), _method(name, group, fmt)))
        return cls(unquantized, groups, list(qc.get("ignore") or []))

    def linear_method(self, layer, prefix, checkpoint_names):
        chosen = {name: self._scheme_of(name) for name in checkpoint_names}
        methods = set(map(id, chosen.values()))
        if len(methods) > 1:
            raise ValueError(
                f"{NAME}: {', '.join(checkpoint_names)} are one layer here ({prefix}) but are quantized "
                "differently in the checkpoint"
            )
        method = next(iter(chosen.values()))
        return self.unquantized if method is None else method

    def _scheme_of(self, name: str):
        if any(_matches(name, pattern) for pattern in self.ignore):
            return None
        for targets, method in self.groups:
            if any(t == "Linear" or _matches(name, t) for t in targets):
                return method
        return None

    def expert_method(self, layer, prefix):
        raise ValueError(f"{NAME}: MoE experts ({prefix}) are not supported quantized")


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors' target / ignore rule: `re:` a regular expression, else the module's name (or
    its last components)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _method(group: str, config: dict, fmt: str | None) -> LinearMethod:
    """The method for one config group's scheme; ValueError naming what is not served."""
    w, a = config.get("weights"), config.get("input_activations")
    where = f"{NAME} {group}"
    if not w:
        raise ValueError(f"{where}: a group without weights arguments is not supported")
    if fmt not in LINEAR_FORMATS:
        raise ValueError(f"{where}: format {fmt!r} is not supported; supported: {', '.join(LINEAR_FORMATS)}")
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
    symmetric = w.get("symmetric", True)
    scheme = f"{kind}{bits} weights, strategy {strategy!r}{'' if symmetric else ', asymmetric'}"
    if w.get("actorder") not in (None, False, "static") or w.get("block_structure"):
        raise ValueError(f"{where}: {scheme} with actorder / block_structure is not supported")
    if w.get("dynamic"):
        raise ValueError(f"{where}: dynamic weight quantization is not supported")
    if a is not None:
        if not a.get("dynamic") or a.get("type", "int") != kind or a.get("num_bits") != 8:
            raise ValueError(
                f"{where}: input activations {a.get('type')}{a.get('num_bits')} "
                f"{'dynamic' if a.get('dynamic') else 'static'} are not supported (dynamic 8-bit only)"
            )
        if a.get("strategy") not in ("token", "tensor") or not a.get("symmetric", True):
            raise ValueError(f"{where}: input activations strategy {a.get('strategy')!r} is not supported")
    if fmt == "float-quantized" or kind == "float":
        if kind == "float" and bits == 8 and strategy in ("channel", "tensor") and symmetric:
            per_token = a is not None and a.get("strategy") == "token"
            return Fp8Method(strategy == "tensor", a is not None, per_token)
    elif fmt == "pack-quantized":
        if a is None and bits == 4 and strategy in ("group", "channel"):
            return PackedIntMethod(4, w.get("group_size") if strategy == "group" else None, symmetric)
        if a is None and bits == 8 and strategy == "channel" and symmetric:
            return PackedIntMethod(8, None, True)
    elif kind == "int" and bits == 8 and strategy == "channel" and symmetric:
        return Int8Method(a is not None and a.get("strategy") == "token")
    raise ValueError(f"{where}: format {fmt!r} with {scheme} is not supported")


class Int8Method(LinearMethod):
    """int-quantized: weight int8 [N, K] and weight_scale [N, 1], per channel, symmetric."""

    def __init__(self, w8a8: bool):
        self.w8a8 = w8a8

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        n = sum(output_partition_sizes)
        add_param(layer, "weight", (n, input_size_per_partition), torch.int8, output_dim=0, input_dim=1)
        add_param(layer, "weight_scale", (n, 1), torch.float32, output_dim=0)

    def process_weights_after_loading(self, layer) -> None:
        q, scale = layer.weight.detach(), layer.weight_scale.detach().reshape(-1)
        del layer.weight, layer.weight_scale
        products.pack_int8(layer, q, scale, w8a8=self.w8a8)

    def apply(self, layer, x, bias=None):
        if self.w8a8 and getattr(layer, "cpu_packed", None) is None:  # PackedInt8: fbgemm on CPU
            y = layer.packed.matmul_dynamic(x)
            return y if bias is None else y + bias
        return products.int8_product(layer, x, bias)


class PackedIntMethod(LinearMethod):
    """pack-quantized: weight_packed int32 [N, K * bits / 32] (value i of a row at bits bits * (i % per)
    of word i // per, offset by 2^(bits-1)), weight_scale [N, K / group] (channel: [N, 1]),
    weight_zero_point int32 [N * bits / 32, K / group] (packed along the outputs; asymmetric only),
    weight_shape [2] per checkpoint module."""

    def __init__(self, bits: int, group_size: int | None, symmetric: bool):
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.per_word = 32 // bits

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        n, k, per = sum(output_partition_sizes), input_size_per_partition, self.per_word
        g = self.group_size or k
        if k % per or k % g:
            raise ValueError(
                f"{NAME}: {k} input features per rank are not whole groups of {g} ({per} values a word); "
                "try another --tensor-parallel-size"
            )
        add_param(
            layer, "weight_packed", (n, k // per), torch.int32, output_dim=0, input_dim=1, input_per=per
        )
        scale_in = dict(input_dim=1, input_per=g) if self.group_size else {}
        add_param(layer, "weight_scale", (n, k // g), torch.float32, output_dim=0, **scale_in)
        if not self.symmetric:
            add_param(
                layer,
                "weight_zero_point",
                (n // per, k // g),
                torch.int32,
                output_dim=0,
                output_per=per,
                **scale_in,
            )
        shape = add_param(layer, "weight_shape", (len(output_partition_sizes), 2), torch.int64, per_part=True)
        shape.dummy_value = torch.tensor([[size, layer.input_size] for size in layer.output_sizes])

    def process_weights_after_loading(self, layer) -> None:
        # Each checkpoint module's own shape, or a fused tensor's (Phi-3's qkv_proj) given to every part.
        got, k = layer.weight_shape.tolist(), layer.input_size
        fused = [[sum(layer.output_sizes), k]] * len(got)
        if got != [[size, k] for size in layer.output_sizes] and got != fused:
            raise ValueError(f"{NAME}: weight_shape {got} does not match {type(layer).__name__}'s shape")
        q = unpack(layer.weight_packed.detach(), self.bits)  # values 0 .. 2^bits - 1
        scale = layer.weight_scale.detach()
        del layer.weight_packed, layer.weight_scale, layer.weight_shape
        if self.bits == 8:
            products.pack_int8(layer, (q.to(torch.int16) - 128).to(torch.int8), scale.reshape(-1))
        else:
            zero = None
            if not self.symmetric:
                zero = unpack(layer.weight_zero_point.detach().t(), self.bits).t().float()
                del layer.weight_zero_point
            layer.packed = PackedInt4.pack(q, scale, zero, self.group_size or q.shape[1])

    def apply(self, layer, x, bias=None):
        if self.bits == 8:
            return products.int8_product(layer, x, bias)
        return products.weight_only(layer.packed, x, bias)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [R, C * 32 / bits] from int32 [R, C] packed as compressed-tensors packs (little-endian: the
    first value in the lowest bits)."""
    raw = packed.contiguous().view(torch.uint8)  # [R, 4C], lowest byte first on little-endian hosts
    if bits == 8:
        return raw
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(raw.shape[0], -1)


class Fp8Method(LinearMethod):
    """float-quantized: weight e4m3 [N, K], weight_scale [N, 1] (channel) or [1] (tensor: one per
    checkpoint module, so a merged layer holds one per part, spread over its rows after loading)."""

    def __init__(self, per_tensor: bool, dynamic_act: bool, per_token: bool):
        self.per_tensor, self.dynamic_act, self.per_token = per_tensor, dynamic_act, per_token

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        n = sum(output_partition_sizes)
        add_param(layer, "weight", (n, input_size_per_partition), products.FP8, output_dim=0, input_dim=1)
        if self.per_tensor:
            add_param(layer, "weight_scale", (len(output_partition_sizes),), torch.float32, per_part=True)
        else:
            add_param(layer, "weight_scale", (n, 1), torch.float32, output_dim=0)

    def process_weights_after_loading(self, layer) -> None:
        scale = layer.weight_scale.detach().reshape(-1)
        if self.per_tensor:  # one scale per part -> one per row
            sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
            scale = scale.repeat_interleave(sizes)
        del layer.weight_scale
        layer.weight_scale = torch.nn.Parameter(scale.contiguous(), requires_grad=False)
        products.pack_fp8(layer, "weight")

    def apply(self, layer, x, bias=None):
        x_scale = None
        if self.dynamic_act and not self.per_token:  # one activation scale for the whole step
            x_scale = x.abs().amax().float().clamp(min=1e-12) / products.FP8_MAX
        return products.fp8_product(layer, x, "weight", bias, self.dynamic_act, x_scale)
