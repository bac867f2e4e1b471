"""Tensor-parallel linear layers and embeddings. Each parameter knows how to load its own shard.

A parameter's `weight_loader(param, source, part=None)` receives the full checkpoint tensor, or a
safetensors slice of it (anything with a shape that can be indexed with slices), and copies in only the
rows or columns this rank holds, so a rank never materialises the whole matrix.

Column-parallel layers split the output features (no communication); row-parallel layers split the input
features and all-reduce their partial sums; the vocab-parallel embedding and LM head split the vocabulary.
Layers that communicate also offer `forward_partial`, this rank's share before the collective, which is
what the sharding tests combine by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.parallel import TensorParallel


def _shape(source) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def _copy(param: torch.Tensor, source, index, name: str) -> None:
    tensor = source[index]
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"{name}: checkpoint shard has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


def _new_param(*shape: int) -> nn.Parameter:
    # Uninitialised: every value is overwritten by the loader, and random init of a large model is slow.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _divide(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise ValueError(f"{what} {total} is not divisible by tensor_parallel_size {world_size}")
    return total // world_size


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split evenly across ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False):
        super().__init__()
        self.tp = tp
        local = _divide(output_size, tp.world_size, "output features")
        # (start row in the full tensor, rows) per part; merged subclasses have one entry per part.
        self.part_ranges = [(tp.rank * local, local)]
        self._make_params(input_size, bias)

    def _make_params(self, input_size: int, bias: bool) -> None:
        rows = sum(n for _, n in self.part_ranges)
        self.weight = _new_param(rows, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _new_param(rows) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source, part: int | None = None) -> None:
        start, rows = self.part_ranges[part or 0]
        offset = sum(n for _, n in self.part_ranges[: part or 0])
        _copy(param.data.narrow(0, offset, rows), source, slice(start, start + rows), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up). Each part is split
    across ranks on its own, so rank r holds [gate shard r; up shard r], not a slice of the stack."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], tp: TensorParallel, bias: bool = False):
        nn.Module.__init__(self)
        self.tp = tp
        self.part_ranges = []
        for size in output_sizes:
            local = _divide(size, tp.world_size, "output features")
            self.part_ranges.append((tp.rank * local, local))
        self._make_params(input_size, bias)
        # Tells the loader that each part comes from its own checkpoint tensor.
        for param in (self.weight, self.bias):
            if param is not None:
                param.num_parts = len(self.part_ranges)

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
        self.num_local_heads = _divide(num_heads, ws, "num_attention_heads")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} is not divisible by num_key_value_heads {num_kv_heads}"
            )
        if ws <= num_kv_heads:
            self.num_local_kv_heads = _divide(num_kv_heads, ws, "num_key_value_heads")
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
        self._make_params(hidden_size, bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.num_parts = 3


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; the partial products are all-reduced.
    The input is expected already split (the output of a column-parallel layer)."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.local_input = _divide(input_size, tp.world_size, "input features")
        self.weight = _new_param(output_size, self.local_input)
        self.weight.weight_loader = self.weight_loader
        self.bias = _new_param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param: nn.Parameter, source, part: int | None = None) -> None:
        start = self.tp.rank * self.local_input
        _copy(param, source, (slice(None), slice(start, start + self.local_input)), "RowParallelLinear")

    @staticmethod
    def bias_loader(param: nn.Parameter, source, part: int | None = None) -> None:
        _copy(param, source, slice(None), "RowParallelLinear bias")

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's summand of x W^T, bias excluded."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.forward_partial(x))
        # After the reduction, so the bias is added once rather than world_size times.
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks in contiguous ranges; a rank embeds the ids in its range, zeros
    the rest, and the all-reduce assembles full embeddings. The vocab is padded up to a multiple of the
    world size (padding rows are zero and never looked up)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = _new_param(self.rows_per_rank, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source, part: int | None = None) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data[rows:].zero_()
        _copy(param.data[:rows], source, slice(self.vocab_start, self.vocab_end), type(self).__name__)

    def forward_partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        return F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.forward_partial(input_ids))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with the vocab split like VocabParallelEmbedding (so tied weights can be shared
    as is); each rank computes its logit columns and rank 0 gathers the full row."""

    def forward_partial(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_to_rank0(self.forward_partial(hidden), dim=-1)
        return None if logits is None else logits[..., : self.vocab_size]
