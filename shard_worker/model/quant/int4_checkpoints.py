"""AWQ and GPTQ checkpoints on the linear-method seam: their tensors loaded in their packed on-disk form,
this rank's shard sliced there (column-parallel layers split N, row-parallel ones split K with the group
scales, zeros and g_idx), then unpacked once (quant/awq.py, quant/gptq.py) into a PackedInt4.

Served:  AWQ   quant_method "awq", version "gemm", 4 bits, zero_point true, any group size dividing
               each rank's input features; modules_to_not_convert honoured.
         GPTQ  quant_method "gptq", 4 bits, sym or not, checkpoint_format "gptq" (zeros stored minus one)
               or "gptq_v2", group size or -1 (per channel), desc_act (act-order: K permuted once at
               load, the input gathered per product; all merged parts must share g_idx, as GPTQ writes
               them, since they quantize the same input).
Refused in one line: other bit widths, AWQ versions (gemv, gemv_fast, marlin, exllama, ipex) and
zero_point false, GPTQ per-module `dynamic` overrides and a quantized lm_head, MoE experts.
The LM head and MoE routers stay unquantized (neither format quantizes them by default).
"""

from __future__ import annotations

import torch

from shard_worker.model.quant import products
from shard_worker.model.quant.awq import unpack_awq
from shard_worker.model.quant.base import LinearMethod, QuantConfig, add_param
from shard_worker.model.quant.gptq import ZERO_OFFSET, unpack_gptq
from shard_worker.model.quant.kernels import PackedInt4

PACK = 8  # 4-bit values per int32


def _bits(name: str, qc: dict) -> None:
    if qc.get("bits", qc.get("w_bit")) != 4:
        raise ValueError(f"{name}: bits {qc.get('bits', qc.get('w_bit'))} is not supported (4 only)")


def _quantized(layer) -> bool:
    from shard_worker.model.layers.embedding import ParallelLMHead
    from shard_worker.model.layers.linear import ReplicatedLinear

    return not isinstance(layer, (ParallelLMHead, ReplicatedLinear))


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, unquantized, group_size: int, not_converted: list[str]):
        super().__init__(unquantized)
        self.method = AWQLinearMethod(group_size)
        self.not_converted = not_converted

    @classmethod
    def from_config(cls, qc: dict, unquantized) -> AWQConfig:
        _bits("awq", qc)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported (gemm only)")
        if not qc.get("zero_point", True):
            raise ValueError("awq: zero_point false is not supported")
        group = qc.get("group_size", qc.get("q_group_size"))
        if not isinstance(group, int) or group <= 0:
            raise ValueError(f"awq: group_size {group!r} is not supported")
        return cls(unquantized, group, list(qc.get("modules_to_not_convert") or []))

    def linear_method(self, layer, prefix, checkpoint_names):
        # transformers' rule: a module is left alone when any entry occurs in its name.
        skip = any(key in name for key in self.not_converted for name in checkpoint_names)
        return self.method if _quantized(layer) and not skip else self.unquantized

    def expert_method(self, layer, prefix):
        raise ValueError(f"awq: MoE experts ({prefix}) are not supported")


class AWQLinearMethod(LinearMethod):
    """qweight int32 [K, N / 8], qzeros int32 [K / g, N / 8], scales [K / g, N] (awq.py)."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        k, n, g = input_size_per_partition, sum(output_partition_sizes), self.group_size
        if k % g:
            raise ValueError(f"awq: {k} input features per rank are not whole groups of {g}")
        packed = dict(output_dim=1, output_per=PACK, input_dim=0)
        add_param(layer, "qweight", (k, n // PACK), torch.int32, **packed)
        add_param(layer, "qzeros", (k // g, n // PACK), torch.int32, **packed, input_per=g)
        add_param(layer, "scales", (k // g, n), torch.float32, output_dim=1, input_dim=0, input_per=g)

    def process_weights_after_loading(self, layer) -> None:
        q, scale, zero = unpack_awq(
            layer.qweight.detach(), layer.qzeros.detach(), layer.scales.detach(), self.group_size
        )
        layer.packed = PackedInt4.pack(q, scale, zero, self.group_size)
        del layer.qweight, layer.qzeros, layer.scales

    def apply(self, layer, x, bias=None):
        return products.weight_only(layer.packed, x, bias)


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, unquantized, method: GPTQLinearMethod):
        super().__init__(unquantized)
        self.method = method

    @classmethod
    def from_config(cls, qc: dict, unquantized) -> GPTQConfig:
        _bits("gptq", qc)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ZERO_OFFSET:
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported ({', '.join(ZERO_OFFSET)})")
        if qc.get("dynamic"):
            raise ValueError("gptq: per-module `dynamic` overrides are not supported")
        if qc.get("lm_head"):
            raise ValueError("gptq: a quantized lm_head is not supported")
        group = qc.get("group_size", 128)
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise ValueError(f"gptq: group_size {group!r} is not supported")
        return cls(unquantized, GPTQLinearMethod(group, bool(qc.get("desc_act")), fmt))

    def linear_method(self, layer, prefix, checkpoint_names):
        return self.method if _quantized(layer) else self.unquantized

    def expert_method(self, layer, prefix):
        raise ValueError(f"gptq: MoE experts ({prefix}) are not supported")


class GPTQLinearMethod(LinearMethod):
    """qweight int32 [K / 8, N], qzeros int32 [G, N / 8], scales [G, N], g_idx int32 [K] (gptq.py).
    Group rows are sliced with K on a row-parallel rank, except with desc_act or per-channel groups,
    where a rank's features may belong to any group: then every rank holds all of them."""

    def __init__(self, group_size: int, desc_act: bool, checkpoint_format: str):
        self.group_size, self.desc_act, self.format = group_size, desc_act, checkpoint_format

    def _group(self, layer) -> int:
        return layer.input_size if self.group_size == -1 else self.group_size

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        k, n, g = input_size_per_partition, sum(output_partition_sizes), self._group(layer)
        if k % PACK or (not self.desc_act and self.group_size != -1 and k % g):
            raise ValueError(f"gptq: {k} input features per rank are not whole words / groups of {g}")
        add_param(layer, "qweight", (k // PACK, n), torch.int32, output_dim=1, input_dim=0, input_per=PACK)
        if self.desc_act or self.group_size == -1:
            groups, by_input = layer.input_size // g, {}
        else:
            groups, by_input = k // g, dict(input_dim=0, input_per=g)
        add_param(
            layer, "qzeros", (groups, n // PACK), torch.int32, output_dim=1, output_per=PACK, **by_input
        )
        add_param(layer, "scales", (groups, n), torch.float32, output_dim=1, **by_input)
        parts = len(output_partition_sizes)
        if parts > 1:  # column-parallel (whole K): each part's own copy, checked equal after loading
            add_param(layer, "g_idx", (parts, k), torch.int32, per_part=True)
        else:
            add_param(layer, "g_idx", (k,), torch.int32, input_dim=0)

    def process_weights_after_loading(self, layer) -> None:
        g_idx = layer.g_idx.detach()
        if g_idx.dim() == 2:
            if not bool((g_idx == g_idx[:1]).all()):
                raise ValueError(f"gptq: the merged parts of {type(layer).__name__} have different g_idx")
            g_idx = g_idx[0]
        k = g_idx.numel()
        if self.group_size == -1:
            group, g_idx = k, None
        elif self.desc_act:
            group = self.group_size
        else:  # plain groups: this rank's own, in order (the checkpoint's g_idx is k // g, not needed)
            if bool((g_idx[1:] < g_idx[:-1]).any()):
                raise ValueError("gptq: g_idx is permuted but desc_act is false")
            group, g_idx = self.group_size, None
        w = unpack_gptq(
            layer.qweight.detach(), layer.qzeros.detach(), layer.scales.detach(), group, g_idx, self.format
        )
        layer.packed = PackedInt4.pack(w.q, w.scale, w.zero, group)
        layer.register_buffer("act_order", w.perm, persistent=False)
        del layer.qweight, layer.qzeros, layer.scales, layer.g_idx

    def apply(self, layer, x, bias=None):
        if layer.act_order is not None:
            x = x.index_select(-1, layer.act_order)
        return products.weight_only(layer.packed, x, bias)
