"""The vocab-parallel embedding and LM head: the vocabulary split across ranks in contiguous ranges."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.layers.linear import LinearBase, copy_checked, new_param
from shard_worker.model.quant.base import bind_now_or_later
from shard_worker.parallel import TensorParallel


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
        self.weight = new_param(self.rows_per_rank, hidden_size)
        self.weight.weight_loader = self.weight_loader
        self.dtype = self.weight.dtype
        # A table kept int8 (quant/gguf.py's GGUFEmbeddingMethod, which sets it): its rows are read from
        # the packed layout the tied LM head multiplies by (cpu_linear.PackedLinear.rows).
        self.quant_method = None

    def weight_loader(self, param: nn.Parameter, source, part: int | None = None) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data[rows:].zero_()
        copy_checked(param.data[:rows], source, slice(self.vocab_start, self.vocab_end), type(self).__name__)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "cpu_packed", None)
        if packed is None:
            return F.embedding(ids, self.weight)
        return packed.rows(ids.reshape(-1), self.dtype).view(*ids.shape, -1)

    def forward_partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        return self._lookup(local_ids).masked_fill_(outside.unsqueeze(-1), 0.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.forward_partial(input_ids))


class ParallelLMHead(LinearBase):
    """Output projection with the vocab split like VocabParallelEmbedding (so tied weights can be shared
    as is); each rank computes its logit columns and rank 0 gathers the full row. A linear layer with a
    method like any other; a tied head (tie) multiplies by the embedding's weight, through the
    unquantized method (which gives it its own copy when it casts or packs)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows_per_rank = -(-vocab_size // tp.world_size)
        start = tp.rank * rows_per_rank
        rows = max(0, min(start + rows_per_rank, vocab_size) - start)
        self._init_geometry(
            hidden_size, (0, hidden_size), [(start, rows)], [0], [vocab_size], [rows_per_rank]
        )
        self.bias = None
        self.tied_to: VocabParallelEmbedding | None = None
        bind_now_or_later(self)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        # A plain reference, not a submodule: the embedding is the body's, named once.
        self.__dict__["tied_to"] = embedding
        if self.quant_method is not None:  # built by hand: the weight exists already
            self.weight = embedding.weight

    def set_method(self, method) -> None:
        if self.tied_to is None:
            return super().set_method(method)
        self.quant_method = method
        self.weight = self.tied_to.weight

    def forward_partial(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, hidden, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_to_rank0(self.forward_partial(hidden), dim=-1)
        return None if logits is None else logits[..., : self.vocab_size]
