"""Paged attention on CPU in any of float32, bfloat16 and float16, over a cache of those or fp8.

Decodes and short queries go to a C++ kernel of our own (csrc/cpu_paged_attention.cpp, built once per
machine: cpu_kernel.py) that reads each token's keys and values in place through the block table, one
work item per (token, KV head) so that a group's query heads share every row read, in float32
arithmetic whatever the storage type. Prefill chunks (PREFILL_MIN_QUERY tokens or more) are attended one
sequence at a time by torch's scaled_dot_product_attention over the sequence's gathered blocks (the
reference path), whose tiled kernel amortises each key over many queries.

Why not flex attention, the float32 path before it: flex's compiled call costs about 0.25 ms a layer at a
batch-1 decode step (dynamo's guards on the block mask's tensors alone ~0.16 ms), 30 layers of it 10-15%
of a SmolLM2 step; and on CPU flex in bfloat16 measured 2.5x slower than in float32, so a bf16 model could
not use it at all. The kernel needs no compilation at start-up beyond its one-second build.

A layer's call is one ctypes call (cpu_ops.py: its keys and values written to their slots, then attended)
over a plan of the step's rows built once by prepare, rather than a cache write of torch ops and a call
whose two dozen arguments were checked and converted again in every layer. Caches of another element type
than the queries (fp8) take the torch write and the per-call path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from shard_worker.attention import cpu_kernel, cpu_ops
from shard_worker.attention.backend import AttentionBackend, AttentionContext, StepBatch, float32_sinks
from shard_worker.attention.reference import attend_sequence

# A sequence with at least this many query tokens in a step is attended by SDPA, shorter ones by the
# kernel (bench/attention.py --cpu-threshold measures where SDPA starts to win).
PREFILL_MIN_QUERY = 16


@dataclass(frozen=True)
class CpuMetadata:
    tokens: torch.Tensor  # [n] int64 step rows the kernel attends
    seq: torch.Tensor  # [n] int64 their sequences
    positions: torch.Tensor  # [n] int64 their positions
    prefills: tuple[tuple[int, int, int, int], ...]  # (sequence, first row, query length, context length)
    plan: cpu_ops.StepPlan | None = None  # the same rows for tp_attention_layer (None: no library)
    plan_address: int = 0
    num_tokens: int = 0  # the step's rows (the plan's slots)
    fault: torch.Tensor | None = None  # [3] int64 the plan's: what the kernel refused (cpu_kernel.check)


class CpuBackend(AttentionBackend):
    name = "cpu"
    supports_image_spans = True  # a sequence with an image in the step takes the SDPA path
    # The kernel takes each head's sink logit into its softmax; prefill chunks go through the
    # reference's attend_sequence, which writes the sink out.
    supports_sinks = True

    @classmethod
    def unsupported(cls, device, dtype):
        if device.type != "cpu" or dtype not in cpu_kernel.QUERY_DTYPES:
            kind = f"{device.type} {str(dtype)[6:]}"
            return f"the CPU kernel runs on CPU in float32, bfloat16 or float16, not {kind}"
        return cpu_kernel.unavailable()

    def unsupported_layer(self, layer):
        if layer.head_dim > cpu_kernel.MAX_HEAD_DIM:
            return f"the CPU kernel takes head_dim up to {cpu_kernel.MAX_HEAD_DIM}, not {layer.head_dim}"
        return None

    def prepare(self, batch: StepBatch) -> CpuMetadata:
        q_lens, c_lens = batch.query_lens_host, batch.seq_lens_host
        starts = np.cumsum(q_lens) - q_lens
        short = q_lens < PREFILL_MIN_QUERY
        if batch.image_spans:  # the kernel is causal: images attend both ways through SDPA's mask
            short &= np.array([not spans for spans in batch.image_spans], dtype=bool)
        if short.all():
            seq = np.repeat(np.arange(len(q_lens)), q_lens)
            tokens = np.arange(batch.num_tokens)
        else:
            ids = np.flatnonzero(short)
            seq = np.repeat(ids, q_lens[ids])
            tokens = np.repeat(starts[ids], q_lens[ids]) + _ranks(q_lens[ids])
        # Token j of sequence s (its j-th in the step) sits at c_lens[s] - q_lens[s] + j.
        positions = (c_lens - q_lens)[seq] + tokens - starts[seq]
        prefills = tuple(
            (int(s), int(starts[s]), int(q_lens[s]), int(c_lens[s])) for s in np.flatnonzero(~short)
        )
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
        tokens, seq, positions = as_tensor(tokens), as_tensor(seq), as_tensor(positions)
        fault = cpu_kernel.new_fault()
        plan = _plan(batch, tokens, seq, positions, fault)
        address = ctypes.addressof(plan) if plan is not None else 0
        return CpuMetadata(tokens, seq, positions, prefills, plan, address, batch.num_tokens, fault)

    def forward(self, layer, q, k, v, kv_cache, ctx):
        md: CpuMetadata = ctx.metadata
        _, num_blocks, block_size, kv_heads, d = kv_cache.shape
        # k and v: [tokens, kv_heads, d] with whole heads contiguous (views of the q/k/v projection's rows).
        if (
            md.plan is None
            or kv_cache.dtype != q.dtype
            or not (q.shape[0] == k.shape[0] == v.shape[0] == md.num_tokens)
            or k.shape[1] != kv_heads
            or k.shape[2] != d
            or q.stride(2) != 1
            or k.stride()[1:] != (d, 1)
            or v.stride()[1:] != (d, 1)
            or not kv_cache.is_contiguous()
        ):
            return super().forward(layer, q, k, v, kv_cache, ctx)
        out = torch.empty_like(q)  # q is not dense (a view of the projection's rows): out is contiguous
        if not out.is_contiguous():
            out = torch.empty(q.shape, dtype=q.dtype)
        code = cpu_kernel.DTYPE_CODES[q.dtype]
        rc = cpu_ops.library().tp_attention_layer(
            md.plan_address,
            code,
            code,
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            kv_cache.data_ptr(),
            num_blocks,
            out.data_ptr(),
            q.shape[1],
            kv_heads,
            d,
            block_size,
            layer.scale,
            1.0,
            1.0,
            layer.sliding_window or 0,
            _sinks_address(layer),
        )
        if rc == -4:
            raise ValueError(f"a KV slot of this step is outside the KV cache's {num_blocks} blocks")
        cpu_kernel.check(rc, md.fault, num_blocks)
        self._prefills(layer, q, kv_cache, ctx, out)
        return out

    def attend(self, layer, q: torch.Tensor, kv_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        md: CpuMetadata = ctx.metadata
        table = ctx.batch.block_table
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cpu_kernel.paged_attention(
            q,
            out,
            kv_cache,
            md.tokens,
            md.seq,
            md.positions,
            table,
            layer.scale,
            layer.k_scale,
            layer.v_scale,
            layer.sliding_window,
            float32_sinks(layer),
        )
        self._prefills(layer, q, kv_cache, ctx, out)
        return out

    def _prefills(self, layer, q, kv_cache, ctx, out) -> None:
        table, spans = ctx.batch.block_table, ctx.batch.image_spans
        for seq, start, q_len, c_len in ctx.metadata.prefills:
            images = spans[seq] if spans else ()
            out[start : start + q_len] = attend_sequence(
                layer, q, kv_cache, table[seq], start, q_len, c_len, images, fast_sinks=True
            )


def _sinks_address(layer) -> int | None:
    sinks = float32_sinks(layer)
    return sinks.data_ptr() if sinks is not None else None


def _plan(batch: StepBatch, tokens, seq, positions, fault) -> cpu_ops.StepPlan | None:
    """The step's rows for tp_attention_layer; None without the library. The metadata keeps the tensors
    it points into alive."""
    table, slots = batch.block_table, batch.slot_mapping
    if cpu_ops.library() is None or table.dtype != torch.int32 or table.stride(1) != 1:
        return None
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        return None
    return cpu_ops.StepPlan(
        tokens.data_ptr(),
        seq.data_ptr(),
        positions.data_ptr(),
        tokens.shape[0],
        table.data_ptr(),
        table.stride(0),
        table.shape[0],
        table.shape[1],
        fault.data_ptr(),
        slots.data_ptr(),
        slots.shape[0],
        torch.get_num_threads(),
    )


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
