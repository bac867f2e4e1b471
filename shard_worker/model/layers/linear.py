"""Tensor-parallel linear layers. Each parameter knows how to load its own shard.

A parameter's `weight_loader(param, source, part=None)` receives the full checkpoint tensor, or a
safetensors slice of it (anything with a shape that can be indexed with slices), and copies in only the
rows or columns this rank holds, so a rank never materialises the whole matrix.

Column-parallel layers split the output features (no communication); row-parallel layers split the input
features and all-reduce their partial sums. Layers that communicate also offer `forward_partial`, this
rank's share before the collective, which is what the sharding tests combine by hand.

A merged parameter (q/k/v, gate/up) declares its parts in `checkpoint_parts`; the loader fills each part
from its own checkpoint tensor (Llama's q_proj, k_proj, v_proj), or all of them from one fused tensor
(Phi-3's qkv_proj, part None), which the weight loader splits at the parts' offsets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.parallel import TensorParallel


def source_shape(source) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def copy_checked(param: torch.Tensor, source, index, name: str) -> None:
    tensor = source[index]
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"{name}: checkpoint shard has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


def new_param(*shape: int) -> nn.Parameter:
    # Uninitialised: every value is overwritten by the loader, and random init of a large model is slow.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b. With W held in a narrower dtype than x (bfloat16 weights on a CPU that multiplies them
    natively, see loader.cast_linear_weights), x is rounded to W's dtype for the product and the product
    comes back in x's: the residual stream, norms, attention and the KV cache keep x's precision. W may be
    prepacked for oneDNN (loader.prepack_linear_weights, CPU)."""
    if weight.dtype == x.dtype:
        return _product(x, weight, bias)
    y = _product(x.to(weight.dtype), weight, None).to(x.dtype)
    return y if bias is None else y + bias


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def divide(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise ValueError(f"{what} {total} is not divisible by tensor_parallel_size {world_size}")
    return total // world_size


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split evenly across ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False):
        super().__init__()
        self.tp = tp
        local = divide(output_size, tp.world_size, "output features")
        # (start row in the full tensor, rows) per part; merged subclasses have one entry per part.
        self.part_ranges = [(tp.rank * local, local)]
        # Where each part starts in a fused checkpoint tensor (all parts stacked along the rows).
        self.fused_offsets = [0]
        self._make_params(input_size, bias)

    def _make_params(self, input_size: int, bias: bool) -> None:
        rows = sum(n for _, n in self.part_ranges)
        self.weight = new_param(rows, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = new_param(rows) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source, part: int | None = None) -> None:
        """part: which part this checkpoint tensor holds; None for a tensor holding them all (fused)."""
        for p in range(len(self.part_ranges)) if part is None else [part]:
            start, rows = self.part_ranges[p]
            start += self.fused_offsets[p] if part is None else 0
            offset = sum(n for _, n in self.part_ranges[:p])
            copy_checked(
                param.data.narrow(0, offset, rows), source, slice(start, start + rows), type(self).__name__
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up). Each part is split
    across ranks on its own, so rank r holds [gate shard r; up shard r], not a slice of the stack."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], tp: TensorParallel, bias: bool = False):
        nn.Module.__init__(self)
        self.tp = tp
        self.part_ranges = []
        for size in output_sizes:
            local = divide(size, tp.world_size, "output features")
            self.part_ranges.append((tp.rank * local, local))
        self.fused_offsets = [sum(output_sizes[:p]) for p in range(len(output_sizes))]
        self._make_params(input_size, bias)
        _declare_parts(self, len(self.part_ranges))

    @property
    def local_sizes(self) -> list[int]:
        return [n for _, n in self.part_ranges]


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads.

    Query heads are divided evenly. KV heads are divided too when there are at least as many as ranks;
    otherwise each KV head is replicated on the ranks whose query heads use it (rank r holds KV head
    r // (world_size // num_kv_heads)), so attention never needs another rank's keys.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TensorParallel,
        bias: bool = False,
    ):
        nn.Module.__init__(self)
        self.tp = tp
        ws, rank = tp.world_size, tp.rank
        self.num_local_heads = divide(num_heads, ws, "num_attention_heads")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} is not divisible by num_key_value_heads {num_kv_heads}"
            )
        if ws <= num_kv_heads:
            self.num_local_kv_heads = divide(num_kv_heads, ws, "num_key_value_heads")
            first_kv = rank * self.num_local_kv_heads
        else:
            if ws % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size {ws} is larger than num_key_value_heads {num_kv_heads} and not a "
                    "multiple of it, so KV heads cannot be replicated evenly"
                )
            self.num_local_kv_heads = 1
            first_kv = rank // (ws // num_kv_heads)
        q_rows, kv_rows = self.num_local_heads * head_dim, self.num_local_kv_heads * head_dim
        self.part_ranges = [
            (rank * q_rows, q_rows),
            (first_kv * head_dim, kv_rows),
            (first_kv * head_dim, kv_rows),
        ]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.fused_offsets = [0, q_size, q_size + kv_size]
        self._make_params(hidden_size, bias)
        _declare_parts(self, 3)


def _declare_parts(layer: ColumnParallelLinear, num_parts: int) -> None:
    # Tells the loader that each part is filled on its own (or all at once from a fused tensor).
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.checkpoint_parts = tuple(range(num_parts))


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (an MoE router: small, and every rank needs every logit)."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.weight = new_param(output_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; the partial products are all-reduced.
    The input is expected already split (the output of a column-parallel layer)."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.local_input = divide(input_size, tp.world_size, "input features")
        self.weight = new_param(output_size, self.local_input)
        self.weight.weight_loader = self.weight_loader
        self.bias = new_param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param: nn.Parameter, source, part: int | None = None) -> None:
        start = self.tp.rank * self.local_input
        copy_checked(
            param, source, (slice(None), slice(start, start + self.local_input)), "RowParallelLinear"
        )

    @staticmethod
    def bias_loader(param: nn.Parameter, source, part: int | None = None) -> None:
        copy_checked(param, source, slice(None), "RowParallelLinear bias")

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's summand of x W^T, bias excluded."""
        return linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.forward_partial(x))
        # After the reduction, so the bias is added once rather than world_size times.
        return y if self.bias is None else y + self.bias
