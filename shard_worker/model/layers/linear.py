"""Tensor-parallel linear layers. Each holds a linear method (shard_worker/model/quant) that creates its
parameters, processes them after loading and applies the product; the layer owns the geometry and the
one weight loader that shards any of those parameters (plain weights, packed int4, group scales).

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
from torch import nn

from shard_worker.model.quant.base import bind_now_or_later
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


def divide(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise ValueError(f"{what} {total} is not divisible by tensor_parallel_size {world_size}")
    return total // world_size


class LinearBase(nn.Module):
    """What every linear layer shares: its geometry, its method (quant/base.py) and the one weight loader
    that shards any of the method's parameters.

    Geometry, in the full checkpoint tensor's coordinates: part_ranges, (first output feature, count)
    of each merged part this rank holds; output_sizes, each part's in all; fused_offsets, where each
    part starts in a fused tensor; input_range, (first input feature, count) this rank holds.
    Column-parallel layers split the outputs, row-parallel ones the inputs. output_partition_sizes: the
    rows each part takes here (the LM head pads its vocabulary shard; padding rows are zero)."""

    def _init_geometry(
        self, input_size: int, input_range, part_ranges, fused_offsets, output_sizes, padded=None
    ) -> None:
        self.input_size = input_size
        self.output_sizes = list(output_sizes)  # each part's full output features (all ranks)
        self.input_range = input_range
        self.part_ranges = part_ranges
        self.fused_offsets = fused_offsets
        self.output_partition_sizes = padded or [n for _, n in part_ranges]
        self.quant_method = None

    def default_method(self):
        from shard_worker.model.quant.unquantized import UnquantizedLinearMethod

        return UnquantizedLinearMethod()

    def set_method(self, method) -> None:
        """Creates the method's parameters (once; load_model calls this after construction, when it knows
        the layer's name) and points each at this layer's loader."""
        self.quant_method = method
        method.create_weights(
            self, self.input_range[1], self.output_partition_sizes, torch.get_default_dtype()
        )
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
            param.checkpoint_parts = _parts(self)

    def _make_bias(self, bias: bool, size: int, sharded: bool) -> None:
        self.bias = None
        if bias:
            self.bias = new_param(size)
            self.bias.output_dim = 0 if sharded else None
            self.bias.input_dim = None

    def weight_loader(self, param: nn.Parameter, source, part: int | None = None) -> None:
        """Copies this rank's shard of a checkpoint tensor into param. part: which merged part the tensor
        holds; None for all of them (a fused tensor, or a layer with one part)."""
        for p in range(len(self.part_ranges)) if part is None else [part]:
            self._load_part(param, source, p, fused=part is None)

    def _load_part(self, param: nn.Parameter, source, p: int, fused: bool) -> None:
        name = type(self).__name__
        if getattr(param, "per_part", False):  # a per-tensor value of each part: shape [parts, ...]
            tensor = source[...]
            if tensor.numel() != param.data[p].numel():
                shape = tuple(tensor.shape)
                raise ValueError(f"{name}: checkpoint tensor has shape {shape}, expected one value")
            param.data[p].copy_(tensor.reshape(param.data[p].shape))
            return
        dest, index = param.data, [slice(None)] * param.dim()
        out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        if out_dim is not None:
            start, rows = self.part_ranges[p]
            start += self.fused_offsets[p] if fused else 0
            offset = sum(self.output_partition_sizes[:p])
            per = getattr(param, "output_per", 1)
            start, rows, offset = (_per(n, per, name) for n in (start, rows, offset))
            size = _per(self.output_partition_sizes[p], per, name)
            dest = dest.narrow(out_dim, offset, size)
            if rows < size:  # the LM head's padding rows
                dest.narrow(out_dim, rows, size - rows).zero_()
                dest = dest.narrow(out_dim, 0, rows)
            index[out_dim] = slice(start, start + rows)
        if in_dim is not None:
            per = getattr(param, "input_per", 1)
            start, cols = (_per(n, per, name) for n in self.input_range)
            index[in_dim] = slice(start, start + cols)
        copy_checked(dest, source, tuple(index), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def _per(features: int, per: int, name: str) -> int:
    """Entries covering this many features, when each entry covers per of them (a packed int32, a group
    scale): a shard boundary inside an entry cannot be served."""
    if features % per:
        raise ValueError(
            f"{name}: a shard boundary at feature {features} falls inside a group of {per} "
            "(group size or packing does not divide this rank's share; try another --tensor-parallel-size)"
        )
    return features // per


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's output rows split evenly across ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False):
        super().__init__()
        self.tp = tp
        local = divide(output_size, tp.world_size, "output features")
        self._init_column(input_size, [(tp.rank * local, local)], [0], [output_size], bias)

    def _init_column(self, input_size: int, part_ranges, fused_offsets, output_sizes, bias: bool) -> None:
        self._init_geometry(input_size, (0, input_size), part_ranges, fused_offsets, output_sizes)
        self._make_bias(bias, sum(self.output_partition_sizes), sharded=True)
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
            self.bias.checkpoint_parts = _parts(self)
        bind_now_or_later(self)


def _parts(layer: LinearBase) -> tuple:
    # Tells the loader that each part of a merged layer is filled on its own (or all at once from a
    # fused tensor).
    return tuple(range(len(layer.part_ranges))) if len(layer.part_ranges) > 1 else (None,)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up). Each part is split
    across ranks on its own, so rank r holds [gate shard r; up shard r], not a slice of the stack."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], tp: TensorParallel, bias: bool = False):
        nn.Module.__init__(self)
        self.tp = tp
        part_ranges = []
        for size in output_sizes:
            local = divide(size, tp.world_size, "output features")
            part_ranges.append((tp.rank * local, local))
        fused_offsets = [sum(output_sizes[:p]) for p in range(len(output_sizes))]
        self._init_column(input_size, part_ranges, fused_offsets, output_sizes, bias)

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
        part_ranges = [
            (rank * q_rows, q_rows),
            (first_kv * head_dim, kv_rows),
            (first_kv * head_dim, kv_rows),
        ]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        offsets = [0, q_size, q_size + kv_size]
        self._init_column(hidden_size, part_ranges, offsets, [q_size, kv_size, kv_size], bias)


class ReplicatedLinear(LinearBase):
    """y = x W^T (+ b) with the whole W on every rank (an MoE router: small, and every rank needs every
    logit; gpt-oss's has a bias)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self._init_geometry(input_size, (0, input_size), [(0, output_size)], [0], [output_size])
        self._make_bias(bias, output_size, sharded=False)
        bind_now_or_later(self)


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's input columns split across ranks; the partial products are all-reduced.
    The input is expected already split (the output of a column-parallel layer)."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.local_input = divide(input_size, tp.world_size, "input features")
        self._init_geometry(
            input_size, (tp.rank * self.local_input, self.local_input), [(0, output_size)], [0], [output_size]
        )
        # Whole on every rank, and added once, after the reduction.
        self._make_bias(bias, output_size, sharded=False)
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        bind_now_or_later(self)

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's summand of x W^T, bias excluded."""
        return self.quant_method.apply(self, x, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.forward_partial(x))
        return y if self.bias is None else y + self.bias
