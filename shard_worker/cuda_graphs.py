"""CUDA graphs for decode steps: captured at start-up per batch-size bucket over static buffers, replayed
when a step is decode-only and fits a bucket; every other step runs eagerly.

Why: a decode step of a 32-layer model is some 500 kernels of microseconds each. Launched one by one from
Python the GPU waits on the launches, not on the math; a graph replays them all from one call.

- Buckets (capture_sizes): 1, 2, 4, 8, then every 8 up to 64 and every 16 after, and max_num_seqs
  itself, so every decode batch the scheduler can form rounds up to one (at most 2x padding below 8,
  at most 15 rows past 64); 15 graphs at the default 128. vLLM and SGLang use lists of this shape.
  Past 512 sequences steps run eagerly (MAX_CAPTURE_SIZE).
- Static buffers (StaticBuffers), sized for the largest bucket, are what every graph reads: input_ids,
  positions, slot_mapping, query_start_loc, seq_lens, block_table, and the hidden states it writes.
  A bucket's graph reads their first `size` rows. Replaying copies the step's rows in (device to
  device, from the StepBatch already built) and resets the padding rows.
- Padding rows are decodes of token 0 at position 0 with a context of one: each writes its key and
  value to slot 0 of the reserved block and attends to that one key, so it touches no sequence's cache
  and gives finite values (which are never read). The reserved block is the cache's last one: the
  model runner allocates one block more than the scheduler was told (shard_worker/model_runner.py).
- What a graph bakes in: the addresses of the static buffers, of the KV caches and of the attention
  backend's workspace, and host ints chosen at capture (tile shapes, the KV split count, from the
  bucket's bounds: query length 1, context max_model_len). Only a backend whose metadata is device
  tensors plus such bounds can be captured (AttentionBackend.graph_capturable: the Triton backend). A new
  KV cache (InitCache) means new graphs.
- Tensor parallel: the row-parallel all-reduces are torch.distributed NCCL collectives, captured into
  the graph with the stream they run on (fork and join through events). What this relies on: NCCL >=
  2.9.6 (capturable collectives; checked at start-up, graphs_unsupported), ProcessGroupNCCL queueing no
  watchdog work for a collective issued while its stream captures (torch >= 2.1), the communicator
  created before capture (init_process_group's device_id, and the profiling step's all-reduces), and
  thread_local capture, so that other threads calling CUDA meanwhile (the NCCL watchdog querying
  earlier work's events, the gRPC threads) do not invalidate it. Every rank captures the same buckets
  in the same order and replays the same bucket for the same step, so collectives match. Collectives
  inside a graph are not timed (allreduce_seconds reads 0 for a replayed step).
- Memory: a capture takes the graphs' shared pool (a decode step's activations at the largest bucket),
  the static buffers and the driver's graph objects. The model runner measures it at profiling time by
  capturing once over a scratch cache (capture_bytes) and leaves it out of the KV cache budget.

On CPU (tests) `capture=False` runs the same object without torch.cuda.graph: each "replay" runs the
forward the graph would have captured, over the same static buffers and padding, so the bucketing, the
padding and the buffers are tested without a GPU.
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Callable

import numpy as np
import torch

from shard_worker.attention import AttentionBackend, AttentionContext, StepBatch

# NCCL's first release whose collectives can be captured in a CUDA graph.
NCCL_CAPTURABLE = (2, 9, 6)
# Past this many sequences a decode step's math dwarfs its launches, and every bucket more is start-up
# time and pool memory (vLLM's default max capture size too): larger batches run eagerly.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for, ascending; the last is max_num_seqs (at most 512)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    candidates = [1, 2, 4, *range(8, 65, 8), *range(80, largest, 16)]
    return (*[s for s in candidates if s < largest], largest)


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size holding num_seqs sequences, None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graphs_unsupported(backend: AttentionBackend, world_size: int, nccl_version) -> str | None:
    """Why decode steps cannot be captured with this backend and group, in one line; None when they can.
    nccl_version: torch.cuda.nccl.version() (a tuple), read only when world_size > 1."""
    if not backend.graph_capturable:
        return (
            f"the {backend.name} attention backend plans each step on the host, so a graph would replay "
            "stale lengths (use --attention-backend triton)"
        )
    if world_size > 1 and tuple(nccl_version) < NCCL_CAPTURABLE:
        have, need = ".".join(map(str, nccl_version)), ".".join(map(str, NCCL_CAPTURABLE))
        return f"NCCL {have} cannot capture collectives in a graph (tensor parallel needs {need} or later)"
    return None


class StaticBuffers:
    """The inputs and output every bucket's graph reads and writes, sized for the largest bucket."""

    def __init__(self, max_size: int, max_blocks: int, hidden_size: int, kv_cache: torch.Tensor):
        device = kv_cache.device
        _, num_blocks, block_size, _, _ = kv_cache.shape
        self.block_size = block_size
        self.reserved_block = num_blocks - 1
        self.pad_slot = self.reserved_block * block_size
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_size,), self.pad_slot, dtype=torch.int64, device=device)
        # One query per sequence in every decode step, real or padding: this never changes.
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.block_table = torch.full(
            (max_size, max_blocks), self.reserved_block, dtype=torch.int32, device=device
        )
        self.hidden = torch.zeros(max_size, hidden_size, dtype=kv_cache.dtype, device=device)

    @property
    def max_blocks(self) -> int:
        return self.block_table.shape[1]

    def batch(self, size: int, max_seq_len: int) -> StepBatch:
        """The StepBatch a bucket's graph is captured with: views of the buffers' first `size` rows, and
        host bounds valid for every step it replays (one query each, contexts up to max_seq_len)."""
        return StepBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            query_lens_host=np.ones(size, dtype=np.int64),
            seq_lens_host=np.full(size, max_seq_len, dtype=np.int64),
            block_size=self.block_size,
        )

    def fill(self, batch: StepBatch, size: int) -> None:
        """The step's rows first, then padding up to size. A larger step before this one left its rows
        past this step's, and a stale slot there would overwrite a live sequence's key: they are reset."""
        n, width = batch.num_seqs, batch.block_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.seq_lens)
        # Columns past the step's width keep older entries: the kernel reads none past a context's blocks.
        self.block_table[:n, :width].copy_(batch.block_table)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.seq_lens[n:size].fill_(1)
            self.block_table[n:size].fill_(self.reserved_block)


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionContext, list[torch.Tensor]], torch.Tensor]


class CudaGraphRunner:
    """Decode graphs of one model over one set of KV caches (whose last block is reserved for padding).

    model(input_ids, positions, ctx, kv_caches) -> [T, hidden] is the forward to capture. capture: None
    for "on CUDA"; False runs the same replay path without graphs (CPU, tests)."""

    def __init__(
        self,
        model: Forward,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        hidden_size: int,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool | None = None,
    ):
        if not kv_caches:
            raise RuntimeError("CUDA graphs are captured over the KV cache: allocate it first")
        if not backend.graph_capturable:
            raise ValueError(f"the {backend.name} attention backend cannot be captured in a graph")
        if capture is None:
            capture = kv_caches[0].device.type == "cuda"
        if capture and kv_caches[0].device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {kv_caches[0].device}")
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.capture = capture
        block_size = kv_caches[0].shape[2]
        max_blocks = -(-max_model_len // block_size)
        self.buffers = StaticBuffers(self.sizes[-1], max_blocks, hidden_size, kv_caches[0])
        self._contexts: dict[int, AttentionContext] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warms every bucket up eagerly (Triton compiles its kernels for each split count, workspaces
        reach their size), then captures them largest first, so the smaller ones reuse the pool memory
        the largest took. Every rank must call this at the same time (the warm-ups all-reduce)."""
        for size in reversed(self.sizes):
            self._contexts[size] = self.backend.context(self.buffers.batch(size, self.max_model_len))
            self._run(size)
        if not self.capture:
            return
        device = self.buffers.hidden.device
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            # Fresh metadata: plans made now find the workspaces at their final size, allocate nothing.
            self._contexts[size] = self.backend.context(self.buffers.batch(size, self.max_model_len))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._run(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(device)

    def bucket(self, batch: StepBatch) -> int | None:
        """The bucket that replays this step, or None: it is not decode-only (some sequence computes
        more than one token), it has more sequences than the largest bucket, or a table too wide."""
        if batch.num_tokens != batch.num_seqs or batch.block_table.shape[1] > self.buffers.max_blocks:
            return None  # every query length is at least 1, so T == S means all are 1 (host ints)
        return bucket_for(batch.num_seqs, self.sizes)

    def replay(self, batch: StepBatch) -> torch.Tensor | None:
        """[S, hidden] for the step's sequences, a view valid until the next replay; None when the
        step must run eagerly (see bucket)."""
        size = self.bucket(batch)
        if size is None or size not in self._contexts or batch.groups:  # captured with one block table
            return None
        self.buffers.fill(batch, size)
        if self.capture:
            self._graphs[size].replay()
        else:
            self._run(size)
        return self.buffers.hidden[: batch.num_seqs]

    def _run(self, size: int) -> None:
        b = self.buffers
        h = self.model(b.input_ids[:size], b.positions[:size], self._contexts[size], self.kv_caches)
        b.hidden[:size].copy_(h)


def capture_bytes(make: Callable[[], CudaGraphRunner]) -> int:
    """Device memory that making and capturing a runner takes (its pool, buffers and workspaces, the
    driver's graph objects), measured by doing it and letting it go again."""
    device = torch.cuda.current_device()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info(device)
    runner = make()
    runner.capture_all()
    free_after, _ = torch.cuda.mem_get_info(device)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return max(0, free_before - free_after)
