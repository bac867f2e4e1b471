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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shard_worker.attention import cpu_kernel
from shard_worker.attention.backend import AttentionBackend, AttentionContext, StepBatch
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


class CpuBackend(AttentionBackend):
    name = "cpu"

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
        return CpuMetadata(as_tensor(tokens), as_tensor(seq), as_tensor(positions), prefills)

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
        )
        for seq, start, q_len, c_len in md.prefills:
            out[start : start + q_len] = attend_sequence(layer, q, kv_cache, table[seq], start, q_len, c_len)
        return out


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
