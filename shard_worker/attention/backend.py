"""What every attention backend is given and must do.

A step reaches the worker as per-sequence lengths and the block tables the worker keeps (see
shard_worker/block_tables.py). `StepBatch.build` turns those into the device tensors every backend
reads: the position and the KV slot of each new token (the one place the slot formula is written),
cumulative query lengths and context lengths. It runs once per step, on the host, and reaches the device
in one non-blocking copy, so nothing in the forward needs to wait for the host.

A backend is chosen once when the worker starts (shard_worker/attention/__init__.py). Per step it builds
its own metadata from the StepBatch (`prepare`); per layer it writes the new keys and values into the
layer's cache and attends (`forward`). The model passes an AttentionContext down to its Attention
layers and knows nothing else about which backend runs.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from shard_worker.attention.kv_dtype import as_bits, store

if TYPE_CHECKING:
    from shard_worker.attention.layer import Attention


@dataclass(frozen=True)
class StepBatch:
    """One step's tokens and sequences, on the device. T tokens of S sequences, each sequence's tokens
    contiguous and in batch order."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: each token's position in its sequence
    slot_mapping: torch.Tensor  # [T] int64: the flat KV slot (block * block_size + offset) it is written to
    query_start_loc: torch.Tensor  # [S + 1] int32: where each sequence's tokens start (cu_seqlens_q)
    seq_lens: torch.Tensor  # [S] int32: tokens in the cache once this step is done (context lengths)
    block_table: torch.Tensor  # [S, max_blocks] int32, rows padded with 0 past a sequence's blocks
    # The same lengths on the host, for backends that plan on the host (flex) and for sizing launches.
    query_lens_host: np.ndarray  # [S] int64
    seq_lens_host: np.ndarray  # [S] int64
    block_size: int
    # The other layer groups' batches (common/kv_cache_spec.py): the same step through each group's block
    # table (its own slot_mapping and block_table). Empty for a model with one group.
    groups: tuple[StepBatch, ...] = ()
    # Per sequence (batch order), or empty when no sequence has any: the (first, end) positions of each
    # image whose placeholders the step computes. A query inside one attends to all of its keys, later
    # ones included (Gemma 3's bidirectional image attention), within the layer's window.
    image_spans: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens_host.max()) if len(self.query_lens_host) else 0

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_host.max()) if len(self.seq_lens_host) else 0

    @classmethod
    def build(
        cls,
        input_ids: np.ndarray,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_table: np.ndarray,
        block_size: int,
        device: torch.device,
        num_blocks: int | None = None,
        group_tables: list[np.ndarray] = (),
        image_spans: tuple = (),
    ) -> StepBatch:
        """input_ids [T], query_lens and context_lens [S] and block_table [S, max_blocks] (int64 numpy
        arrays, as the step arrived), and the other layer groups' tables shaped alike. Raises ValueError
        when they do not describe a valid step, or (given num_blocks, the cache's) when a table holds an
        id outside the cache: no backend then reads or writes past it (the Triton kernels and the C++
        one would, unchecked)."""
        num_seqs, num_tokens = len(query_lens), len(input_ids)
        _check(query_lens, context_lens, block_table, num_tokens, block_size)
        if num_blocks is not None and block_table.size:
            _check_ids(block_table, num_blocks)
        # On the host with numpy, then one copy to the device: these are a few thousand integers, and
        # torch's CPU repeat_interleave runs a parallel region even for 128 elements, which costs
        # milliseconds on a loaded machine (measured: 7.7 ms against 0.05 ms).
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        # Token i of sequence s (its j-th of the step) sits at context_lens[s] - query_lens[s] + j.
        seq = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.repeat(context_lens - query_lens - starts[:-1], query_lens) + np.arange(num_tokens)
        # The slot formula, written once: the token's block from its sequence's table, then its offset.
        slot_mapping = block_table[seq, positions // block_size] * block_size + positions % block_size
        flat = torch.from_numpy(np.concatenate([input_ids, positions, slot_mapping, starts, context_lens]))
        tables = torch.from_numpy(np.ascontiguousarray(block_table, dtype=np.int32))
        if device.type == "cuda":
            flat, tables = flat.pin_memory(), tables.pin_memory()
        flat = flat.to(device, non_blocking=True)
        tables = tables.to(device, non_blocking=True)
        ids, pos, slots, starts_d, c_lens = flat.split([num_tokens] * 3 + [num_seqs + 1, num_seqs])
        return cls(
            input_ids=ids,
            positions=pos,
            slot_mapping=slots,
            query_start_loc=starts_d.to(torch.int32),
            seq_lens=c_lens.to(torch.int32),
            block_table=tables,
            query_lens_host=np.asarray(query_lens, dtype=np.int64),
            seq_lens_host=np.asarray(context_lens, dtype=np.int64),
            block_size=block_size,
            groups=tuple(
                cls.build(
                    input_ids, query_lens, context_lens, t, block_size, device, num_blocks, (), image_spans
                )
                for t in group_tables
            ),
            image_spans=image_spans,
        )


def _check(query_lens, context_lens, block_table, num_tokens: int, block_size: int) -> None:
    num_seqs = len(query_lens)
    if len(context_lens) != num_seqs or block_table.ndim != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} query lengths, {len(context_lens)} context lengths, block table of shape "
            f"{tuple(block_table.shape)}"
        )
    if int(np.sum(query_lens)) != num_tokens:
        raise ValueError(f"query lengths sum to {int(np.sum(query_lens))}, the step has {num_tokens} tokens")
    if num_seqs and not (np.all(query_lens >= 1) and np.all(query_lens <= context_lens)):
        bad = int(np.flatnonzero((query_lens < 1) | (query_lens > context_lens))[0])
        raise ValueError(
            f"sequence {bad}: query_len {int(query_lens[bad])} must be in [1, context_len "
            f"{int(context_lens[bad])}]"
        )
    if num_seqs and int(((context_lens + block_size - 1) // block_size).max()) > block_table.shape[1]:
        raise ValueError(
            f"a context of {int(context_lens.max())} tokens needs more blocks than the block table's "
            f"{block_table.shape[1]} columns"
        )


def _check_ids(block_table: np.ndarray, num_blocks: int) -> None:
    """Every id of the table (padding included: 0) in the cache's [0, num_blocks): a few thousand
    integers, compared on the host before anything reaches the device."""
    bad = (block_table < 0) | (block_table >= num_blocks)
    if bad.any():
        row, column = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"batch row {row}: block id {int(block_table[row, column])} (its block {column}) is outside "
            f"the KV cache's {num_blocks} blocks"
        )


@dataclass(frozen=True)
class AttentionContext:
    """What the model hands down to every Attention layer for one step."""

    backend: AttentionBackend
    batch: StepBatch
    metadata: Any  # the backend's own, from prepare()
    # A model with several layer groups (common/kv_cache_spec.py): each group's context (its own block
    # table and KV slots), indexed by Attention.kv_group. Empty: every layer reads this one.
    groups: tuple[AttentionContext, ...] = ()


class AttentionBackend(ABC):
    """Writes a layer's new keys and values into its cache and attends over each sequence's blocks.

    The cache of a layer is [2, num_blocks, block_size, kv_heads, head_dim] (keys, then values); q is
    [T, heads, head_dim], k and v [T, kv_heads, head_dim], with this rank's heads. Queries are causal
    within their sequence; a layer with a sliding window w lets the query at position p see the keys at
    positions j with p - w < j <= p."""

    name: ClassVar[str]
    # Whether attend() honours a layer's attention sinks (Attention.sinks); a model with sinks is refused
    # at start-up by a backend without (refusal).
    supports_sinks: ClassVar[bool] = False
    # Whether its contexts serve multi-head latent attention layers (attention/latent.py, which attends
    # in torch through the step's block tables); a model with such layers is refused at start by others.
    supports_mla: ClassVar[bool] = True
    # Whether a CUDA graph captured over one step's metadata stays right when replayed with other
    # lengths in the same tensors: true only of metadata made of device tensors and host bounds (not of
    # host-planned tilings or per-sequence loops). shard_worker/cuda_graphs.py captures only such backends.
    graph_capturable: ClassVar[bool] = False
    # Whether attend() honours StepBatch.image_spans (a model with bidirectional image attention is
    # refused at start-up by a backend without).
    supports_image_spans: ClassVar[bool] = False

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.dtype = dtype

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on this device and dtype, in one line; None when it can."""
        return None

    def unsupported_layer(self, layer: Attention) -> str | None:
        """Why this backend cannot run this layer (its heads, head_dim), in one line; None when it can.
        Checked once at start-up, so a model the kernels cannot serve is refused before its weights load."""
        return None

    def refusal(self, layer: Attention) -> str | None:
        """Why this backend cannot run this layer, in one line (what every backend lacks, then its own
        limits); None when it can."""
        if getattr(layer, "latent_dim", 0):  # an MLA layer (attention/latent.py): none of the kernels' limits
            if self.supports_mla:
                return None
            return (
                "multi-head latent attention (DeepSeek-V3) runs in torch on CPU: "
                "--attention-backend cpu, flex or reference"
            )
        if layer.sinks is not None and not self.supports_sinks:
            # flex could weight its output by sigmoid(lse - sink) (with_sinks), but torch's compiled CPU
            # flex returns no log-sum-exp (inductor: "return_lse is not supported yet").
            return (
                f"gpt-oss's attention sinks are not in the {self.name} backend "
                "(--attention-backend cpu, triton or reference serves them)"
            )
        if layer.image_bidirectional and not self.supports_image_spans:
            return (
                "the bidirectional attention among an image's tokens is in the cpu and reference backends "
                "only (--attention-backend cpu or reference)"
            )
        return self.unsupported_layer(layer)

    def prepare(self, batch: StepBatch) -> Any:
        """The backend's per-step metadata, built once and read by every layer."""
        return None

    def context(self, batch: StepBatch) -> AttentionContext:
        groups = tuple(self.context(b) for b in batch.groups)  # each layer group's (Attention.kv_group)
        ctx = AttentionContext(self, batch, self.prepare(batch))
        return dataclasses.replace(ctx, groups=(ctx, *groups)) if groups else ctx

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, ctx.batch.slot_mapping, layer.k_scale, layer.v_scale)
        return self.attend(layer, q, kv_cache, ctx)

    @abstractmethod
    def attend(
        self, layer: Attention, q: torch.Tensor, kv_cache: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """[T, heads, head_dim]: each query attended over its sequence's keys (this step's included)."""


def float32_sinks(layer: Attention) -> torch.Tensor | None:
    """The layer's sinks as the kernels read them (float32, contiguous), converted once and kept (the
    model's parameter is in the model's dtype), again only if the tensor or its contents changed (so a
    CUDA graph captured after the weights loaded keeps reading the same address)."""
    sinks = layer.sinks
    if sinks is None:
        return None
    key = (id(sinks), sinks._version)
    kept = getattr(layer, "_kernel_sinks", None)
    if kept is None or kept[0] != key:
        kept = (key, sinks.detach().float().contiguous())
        layer._kernel_sinks = kept
    return kept[1]


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [..., d] attended without the sinks, lse [...] its log-sum-exp of scores, sinks broadcasting
    to lse: out weighted as if each sink's logit had been in the softmax's denominator, which scales
    the weights by sum / (sum + exp(sink)) = sigmoid(lse - sink)."""
    return out * torch.sigmoid(lse - sinks.to(lse.dtype)).unsqueeze(-1).to(out.dtype)


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Stores the step's keys and values at their slots (one indexed copy each, capturable in a graph),
    rounded to the cache's dtype (kv_dtype.py)."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    slots = as_bits(kv_cache.view(2, num_blocks * block_size, kvh * d))
    k, v = store(k, kv_cache.dtype, k_scale), store(v, kv_cache.dtype, v_scale)
    slots[0].index_copy_(0, slot_mapping, as_bits(k.reshape(-1, kvh * d)))
    slots[1].index_copy_(0, slot_mapping, as_bits(v.reshape(-1, kvh * d)))
