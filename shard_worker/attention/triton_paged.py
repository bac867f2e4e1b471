"""The CUDA attention backend: the Triton paged-attention kernel (kernels/) over the cache in place.

One launch per layer serves the whole step (prefill chunks, cached contexts and decodes alike) from
tensors the StepBatch already holds on the device: query_start_loc, seq_lens and the block table. The
per-step metadata is those tensors plus two host ints, the longest query and the longest context, read
from the step's host lengths (numpy), never from the device: a forward never waits on the GPU, and a
CUDA graph captured over static buffers replays with any lengths in them (the ints only pick tile shapes
and the KV split count, so a graph bucket passes loose bounds; see shard_worker/cuda_graphs.py).

The split-KV workspace (partial outputs and log-sum-exps of long-context decodes spread over the SMs)
belongs to the backend: one float32 buffer, grown to the largest step that split so far. A split happens
only while num_seqs x kv_heads programs would leave SMs idle, so its size is tokens x heads x splits x
(head_dim + 1) for a step of few tokens: bounded by the step's tokens, kilobytes to a few MiB. Each
step's metadata keeps the buffer it planned with, so a graph captured over one keeps it alive even if a
later step grows the backend's.

On CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 in the environment before the
process imports them): slow, for tests of the real serving path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from shard_worker.attention.backend import AttentionBackend, AttentionContext, StepBatch, float32_sinks

# What the kernels take (kernels/host.py SUPPORTED_DTYPES; repeated so that refusing needs no triton).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class TritonMetadata:
    """One step's kernel arguments, shared by every layer."""

    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    num_tokens: int
    max_query_len: int  # host bounds: they choose tiles and splits, never which keys are read
    max_seq_len: int
    # (kv_heads, queries per kv head, head_dim) -> (KV splits, the workspace they use or None): planned
    # by the first layer of that shape (every layer of a Llama has one).
    plans: dict[tuple[int, int, int], tuple[int, torch.Tensor | None]] = field(default_factory=dict)


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_sinks = True  # folded into the kernel's softmax (or the split combine)
    supports_mla = False  # no MLA kernel (attention/latent.py's per-sequence torch path is for CPU)
    # The metadata holds only device tensors and bounds, so a graph replays it with new lengths.
    graph_capturable = True

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__(device, dtype)
        from shard_worker.attention import kernels  # imports triton (unsupported() made sure it can)

        self._kernels = kernels
        # Streaming multiprocessors the split rule fills. The interpreter has none to fill: 1 turns
        # splitting off there unless a test sets more.
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        )
        self._workspace: torch.Tensor | None = None

    @classmethod
    def unsupported(cls, device, dtype):
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type == "cuda":
            if interpret:
                return "TRITON_INTERPRET=1 is set: on CUDA the kernels must be compiled, unset it"
        elif device.type == "cpu":
            if not interpret:
                return (
                    "on CPU the Triton kernels run only under Triton's interpreter: set TRITON_INTERPRET=1 "
                    "in the environment (slow; for tests), or use --attention-backend flex or reference"
                )
        else:
            return f"the Triton kernels run on CUDA (or CPU under TRITON_INTERPRET=1), not {device.type}"
        if dtype not in DTYPES:
            return f"the Triton kernels take float16, bfloat16 or float32, not {str(dtype)[6:]}"
        try:
            from shard_worker.attention import kernels
        except ImportError as e:
            return f"triton is not importable ({e}): install the version torch names (pip install triton)"
        if interpret != kernels.INTERPRET:
            # Triton reads the variable when the kernels' module is imported, as the kernels do.
            return "TRITON_INTERPRET changed after shard_worker.attention.kernels was imported"
        return None

    def unsupported_layer(self, layer) -> str | None:
        k = self._kernels
        if layer.head_dim > k.MAX_HEAD_DIM:
            return f"head_dim {layer.head_dim} exceeds the kernels' {k.MAX_HEAD_DIM} (registers)"
        if layer.queries_per_kv > k.MAX_QUERIES_PER_KV:
            return (
                f"{layer.queries_per_kv} query heads per KV head exceed the kernels' "
                f"{k.MAX_QUERIES_PER_KV} (one tile's rows)"
            )
        return None

    def prepare(self, batch: StepBatch) -> TritonMetadata:
        return TritonMetadata(
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            num_tokens=batch.num_tokens,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
        )

    def attend(self, layer, q: torch.Tensor, kv_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        md: TritonMetadata = ctx.metadata
        kv_heads = kv_cache.shape[3]
        key = (kv_heads, layer.queries_per_kv, layer.head_dim)
        plan = md.plans.get(key)
        if plan is None:
            plan = md.plans[key] = self._plan(md, layer.num_heads, *key)
        num_kv_splits, workspace = plan
        # Every row is written: a step's rows are all its sequences' queries (graph padding included).
        out = torch.empty_like(q)
        return self._kernels.paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            md.block_table,
            md.query_start_loc,
            md.seq_lens,
            layer.scale,
            sliding_window=layer.sliding_window or 0,
            out=out,
            max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
            num_kv_splits=num_kv_splits,
            workspace=workspace,
            sinks=float32_sinks(layer),
        )

    def _plan(
        self, md: TritonMetadata, num_heads: int, kv_heads: int, queries_per_kv: int, head_dim: int
    ) -> tuple[int, torch.Tensor | None]:
        num_seqs = md.seq_lens.shape[0]
        splits = self._kernels.plan_kv_splits(
            num_seqs, kv_heads, queries_per_kv, md.max_query_len, md.max_seq_len, self.num_sms
        )
        if splits == 1:
            return 1, None
        needed = self._kernels.kv_split_workspace_numel(md.num_tokens, num_heads, head_dim, splits)
        if self._workspace is None or self._workspace.numel() < needed:
            # A new buffer, not a resize: metadata (a captured graph's) may still hold the old one.
            self._workspace = torch.empty(needed, dtype=torch.float32, device=self.device)
        return splits, self._workspace

    @property
    def workspace_bytes(self) -> int:
        return 0 if self._workspace is None else self._workspace.numel() * 4
