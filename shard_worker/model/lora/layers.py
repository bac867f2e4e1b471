"""LoRA as a wrapper linear method: y = base(x) + (x A_s^T) B_s^T for each row's adapter s.

Every adapter the worker serves sits in a slot of each adapted layer's stacked weights, held in this
rank's shard (as the base layer is split: a column-parallel layer's B by the rows of each merged part
this rank holds, a row-parallel layer's A by its input columns; the row-parallel product then joins the
base partial sums before their one all-reduce, which is linear in both):

    lora_a [slots, parts * R, in_local]      part p's A in rows p*R .. p*R + r (zero beyond its rank)
    lora_b [slots, out_local, parts * R]     part p's B (scaled) in its own output rows and columns p*R..

so a merged q/k/v or gate/up layer takes one shrink and one expand per step (block-diagonal B: each part's
rows read only that part's A). R is --max-lora-rank.

Which rows use which slot is the step's LoRABatch (a context variable the runner sets around the model's
forward: linear layers get no per-step argument). The rows with an adapter are gathered sorted by slot,
and both products run as one grouped matmul over the slots' segments (F.grouped_mm) where torch takes the
operands, else as one product per adapter present in the step (at most --max-loras, never per sequence).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from shard_worker.model.quant.base import LinearMethod


@dataclass
class LoRABatch:
    """The step's rows with an adapter: order [n], their row indices sorted by slot; counts[s] of them
    use slot s (offsets: the running sums as int32, for grouped_mm). padded: when the slots' shares are
    even (a decode step spread over adapters), each sorted row's place in a [slots * width] padding of
    them, width = the largest count: one batched product per side instead of one small one per slot."""

    order: torch.Tensor
    counts: list[int]
    offsets: torch.Tensor
    padded: torch.Tensor | None = None
    width: int = 0

    @classmethod
    def build(cls, seq_slots, query_lens, num_slots: int, device) -> LoRABatch | None:
        """From each sequence's slot (-1: the base model) and its rows this step; None if no row
        has an adapter."""
        rows = np.repeat(np.asarray(seq_slots, dtype=np.int64), np.asarray(query_lens, dtype=np.int64))
        adapted = np.flatnonzero(rows >= 0)
        if not len(adapted):
            return None
        order = adapted[np.argsort(rows[adapted], kind="stable")]
        counts = np.bincount(rows[adapted], minlength=num_slots)
        ends = np.cumsum(counts)
        padded, width = None, int(counts.max())
        # At most twice the rows' work in padding: then the batched product is the faster (1.6x for 8
        # slots of 4 rows on CPU, where grouped_mm runs one small product per slot).
        if width * num_slots <= 2 * len(order):
            slot = rows[order]
            padded = torch.from_numpy(slot * width + np.arange(len(order)) - (ends - counts)[slot]).to(device)
        return cls(
            torch.from_numpy(order).to(device),
            counts.tolist(),
            torch.from_numpy(ends.astype(np.int32)).to(device),
            padded,
            width,
        )


_batch: ContextVar[LoRABatch | None] = ContextVar("tpserve_lora_batch", default=None)


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """Scopes the step's adapter rows to one forward."""
    token = _batch.set(batch)
    try:
        yield
    finally:
        _batch.reset(token)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """[n, out]: (x A_s^T) B_s^T for the batch's rows of x in batch.order, a [slots, K, in], b [slots,
    out, K]."""
    xs = x.index_select(0, batch.order)
    if batch.padded is not None:  # a.transpose(1, 2) is contiguous: LoRALinearMethod holds it so
        slots, width = a.shape[0], batch.width
        rows = xs.new_zeros(slots * width, xs.shape[1]).index_copy_(0, batch.padded, xs)
        shrink = torch.bmm(rows.view(slots, width, -1), a.transpose(1, 2))
        return torch.bmm(shrink, b.transpose(1, 2)).view(slots * width, -1).index_select(0, batch.padded)
    if _grouped_ok(xs, a, b):
        shrink = F.grouped_mm(xs, a.transpose(1, 2), offs=batch.offsets)
        return F.grouped_mm(shrink, b.transpose(1, 2), offs=batch.offsets)
    out = torch.empty(xs.shape[0], b.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for slot, n in enumerate(batch.counts):  # the adapters present in this step, at most --max-loras
        if n:
            seg = slice(start, start + n)
            out[seg] = F.linear(F.linear(xs[seg], a[slot]), b[slot])
            start += n
    return out


def _grouped_ok(xs: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    from shard_worker.model.layers.moe import grouped_mm_supported

    return a.dtype == xs.dtype and grouped_mm_supported(xs, a.shape[1], a.shape[2], b.shape[1])


class LoRALinearMethod(LinearMethod):
    """Wraps a layer's own method (unquantized or any quantized one): its weights and product are the
    base's; the adapters' stacked weights are this method's."""

    def __init__(self, base: LinearMethod, lora_a: torch.Tensor, lora_b: torch.Tensor, occupied=None):
        """occupied[s]: slot s holds an adapter that adapts this layer (None: every slot does)."""
        self.base = base
        # Held transposed ([slots, in, K] and [slots, K, out], contiguous): the grouped products' own
        # operands (a strided one costs the shrink 1.8x on CPU); lora_a / lora_b are views of them.
        self.a_t = lora_a.transpose(1, 2).contiguous()
        self.b_t = lora_b.transpose(1, 2).contiguous()
        self.occupied = [True] * lora_a.shape[0] if occupied is None else list(occupied)

    @property
    def lora_a(self) -> torch.Tensor:
        """[slots, K, in] (a view: writing it writes the held weights)."""
        return self.a_t.transpose(1, 2)

    @property
    def lora_b(self) -> torch.Tensor:
        """[slots, out, K] (a view)."""
        return self.b_t.transpose(1, 2)

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        self.base.create_weights(layer, input_size_per_partition, output_partition_sizes, params_dtype)

    def process_weights_after_loading(self, layer) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        y = self.base.apply(layer, x, bias)
        batch = _batch.get()
        # Skipped when the step's adapters leave this layer alone (the same on every rank).
        if batch is None or not any(n and o for n, o in zip(batch.counts, self.occupied, strict=False)):
            return y
        delta = lora_delta(x.reshape(-1, x.shape[-1]), self.lora_a, self.lora_b, batch)
        # In place: the base product is this call's own fresh tensor.
        y.view(-1, y.shape[-1]).index_add_(0, batch.order, delta.to(y.dtype))
        return y


def stack_layer(layer, placed: list[dict[int, tuple]], max_rank: int, dtype, device):
    """(lora_a, lora_b) for one layer from each slot's {part: (A full, B full scaled)} (empty: that
    adapter leaves the layer alone), cut to this rank's shard."""
    parts = len(layer.output_sizes)
    k = parts * max_rank
    in_start, in_local = layer.input_range
    out_local = sum(layer.output_partition_sizes)
    row_parallel = in_local != layer.input_size
    a_all = torch.zeros(len(placed), k, in_local, dtype=dtype, device=device)
    b_all = torch.zeros(len(placed), out_local, k, dtype=dtype, device=device)
    for slot, pairs in enumerate(placed):
        for part, (a, b) in pairs.items():
            r = a.shape[0]
            cols = slice(part * max_rank, part * max_rank + r)
            a_all[slot, cols] = a[:, in_start : in_start + in_local] if row_parallel else a
            if row_parallel:
                b_all[slot, :, cols] = b
            else:
                start, rows = layer.part_ranges[part]
                offset = sum(layer.output_partition_sizes[:part])
                b_all[slot, offset : offset + rows, cols] = b[start : start + rows]
    return a_all, b_all
