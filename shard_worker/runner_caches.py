"""The rank's KV caches, as ModelRunner holds them: sized (the worst step's peak on CUDA, a host budget on
CPU), allocated, swapped to and from host memory, captured in CUDA graphs, and the synthetic steps that
size and warm them before a first request comes.

A mixin of ModelRunner (it reads the runner's model, device, draft model and attention backend, and runs
its execute): the caches' lifecycle is one idea, running a step another.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator

import torch

from common.kv_cache_spec import split_budget
from common.sampling import SamplingConfig
from shard_worker.attention.kv_dtype import as_bits
from shard_worker.capacity import CudaMemory, kv_budget, synthetic_step, worst_step
from shard_worker.cuda_graphs import CudaGraphRunner, capture_bytes
from shard_worker.step import SequenceInit
from shard_worker.warm_up import warm_up_steps

log = logging.getLogger("tpserve.shard_worker")


class RunnerCaches:
    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one KV block takes on this rank, over all layers (the draft model's block of the same id
        included: the two caches are allocated, swapped and freed together)."""
        per_cache = math.prod(self.model.kv_cache_shape(1, block_size)) * self.kv_dtype.itemsize
        draft = self.draft.kv_block_bytes(block_size) if self.draft is not None else 0
        return self.model.num_kv_caches * per_cache + draft

    def state_slot_bytes(self) -> int:
        """Bytes one sequence's recurrent state takes on this rank (linear-attention layers; 0 for none)."""
        return self.model.state_slot_bytes(self.dtype) if getattr(self.model, "has_state", False) else 0

    def profile_num_blocks(
        self,
        block_size: int,
        max_num_batched_tokens: int,
        gpu_memory_utilization: float,
        cpu_kv_cache_gib: float,
        max_num_seqs: int,
        max_model_len: int | None = None,
    ) -> int:
        """KV blocks this rank can hold. On CUDA, after running the worst step the scheduler can form with
        these limits (max_num_seqs: the scheduler's sequence cap; max_model_len: None or 0 for the model's
        max_position_embeddings), whose memory peak the cache must leave room for; the step also compiles
        the attention kernels. It runs a forward pass with collectives, so every rank must profile at the
        same time. On CPU the cache is the host budget cpu_kv_cache_gib, and nothing runs (a worst step
        at SmolLM2's 8192 positions took a minute there, to measure a peak the budget does not use):
        call warm_up before serving."""
        # A scheduler reconnecting to a live worker profiles again: drop the old caches first, or their
        # memory would count against the new ones (InitCache always follows and allocates afresh).
        self.kv_caches = []
        self.host_kv_caches = []
        self.graphs = None
        if self.draft is not None:
            self.draft.kv_caches, self.draft.host_kv_caches = [], []
        per_block = self.kv_block_bytes(block_size)
        max_model_len = min(
            max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        if self.device.type != "cuda":
            budget = int(cpu_kv_cache_gib * 2**30)
        else:
            memory = CudaMemory(self.device)
            memory.empty_cache()
            free, total = memory.mem_get_info()
            # The CUDA context, NCCL buffers and other processes: memory our allocator does not manage.
            outside_torch = total - free - memory.reserved()
            weights = memory.allocated()
            peak = self._dummy_step(block_size, max_num_batched_tokens, max_num_seqs, max_model_len, memory)
            memory.empty_cache()
            graphs = self._graph_bytes(block_size, max_num_seqs, max_model_len) if self.cuda_graphs else 0
            budget = kv_budget(total, gpu_memory_utilization, outside_torch, weights, peak) - graphs
            log.info("rank %d: CUDA graphs take %.1f MiB", self.tp.rank, graphs / 2**20)
        # Linear-attention layers: a state slot per sequence first, from the same budget
        # (common/kv_cache_spec.py split_budget); the rest in blocks.
        blocks, self.num_state_slots = split_budget(budget, per_block, self.state_slot_bytes(), max_num_seqs)
        num_blocks = blocks - self.reserved_blocks
        if num_blocks < 1 or (self.state_slot_bytes() and not self.num_state_slots):
            raise RuntimeError(
                f"no memory left for the KV cache: budget {budget / 2**20:.1f} MiB, one block needs "
                f"{per_block / 2**20:.2f} MiB (raise gpu_memory_utilization or cpu_kv_cache_gib)"
            )
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> int:
        """Allocates every layer's [2, blocks, block_size, local_kv_heads, head_dim] cache; returns bytes.
        With CUDA graphs, one block more: block num_blocks is the padding rows' (see cuda_graphs.py)."""
        self.graphs = None  # they write to the old cache: recaptured by capture_cuda_graphs
        total = num_blocks + self.reserved_blocks
        self.kv_caches = []  # frees an old cache first, so reallocating never needs room for both
        self.kv_caches = self.model.new_kv_caches(total, block_size, self.kv_dtype, self.device)
        self.block_size = block_size
        self.num_kv_blocks = total  # every step's block ids are checked against it (StepBatch.build)
        if self.draft is not None:
            self.draft.allocate(total, block_size)
        return total * self.kv_block_bytes(block_size)

    def allocate_state_cache(self, num_slots: int, num_host_slots: int = 0) -> int:
        """The recurrent-state slots (and their swap space), per linear-attention layer; returns bytes."""
        self.state_caches, self.host_state_caches = [], []
        if not num_slots or not getattr(self.model, "has_state", False):
            return 0
        self.state_caches = self.model.new_state_caches(num_slots, self.dtype, self.device)
        if num_host_slots:
            self.host_state_caches = self.model.new_state_caches(
                num_host_slots, self.dtype, self.device, True
            )
        return (num_slots + num_host_slots) * self.state_slot_bytes()

    @torch.inference_mode()
    def swap_states(self, src_slots: list[int], dst_slots: list[int], out: bool) -> None:
        """Copies state slot src_slots[i] to dst_slots[i] in every linear layer: device to host (out) or
        host to device."""
        src, dst = (
            (self.state_caches, self.host_state_caches)
            if out
            else (self.host_state_caches, self.state_caches)
        )
        src_index = torch.tensor(src_slots, dtype=torch.long)
        dst_index = torch.tensor(dst_slots, dtype=torch.long)
        for layer_src, layer_dst in zip(src, dst, strict=True):
            for s, d in zip(layer_src, layer_dst, strict=True):
                d.index_copy_(
                    0, dst_index.to(d.device), s.index_select(0, src_index.to(s.device)).to(d.device)
                )

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> float:
        """Captures the decode graphs over the allocated cache (every rank at once: they all-reduce);
        returns the seconds it took. Nothing to do without cuda_graphs or without max_num_seqs."""
        if not self.cuda_graphs or not max_num_seqs:
            return 0.0
        start = time.perf_counter()
        self.graphs = self._graph_runner(max_num_seqs, max_model_len)
        self.graphs.capture_all()
        return time.perf_counter() - start

    def _graph_runner(self, max_num_seqs: int, max_model_len: int) -> CudaGraphRunner:
        limit = self.config.max_position_embeddings
        return CudaGraphRunner(
            self.model,
            self.attention,
            self.kv_caches,
            self.config.hidden_size,
            max_num_seqs,
            min(max_model_len or limit, limit),
        )

    def _graph_bytes(self, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
        """What capturing will take, by capturing over a cache of just the reserved block (the
        warm-ups and captures read only padding rows)."""
        with self._scratch_cache(0, block_size), torch.inference_mode():
            return capture_bytes(lambda: self._graph_runner(max_num_seqs, max_model_len))

    def allocate_host_kv_cache(self, num_blocks: int, block_size: int) -> int:
        """Allocates the swap space: num_blocks host blocks laid out like the device cache; returns bytes."""
        self.host_kv_caches = []
        self.host_kv_caches = self.model.new_kv_caches(
            num_blocks, block_size, self.kv_dtype, self.device, host=True
        )
        if self.draft is not None:
            self.draft.allocate_host(num_blocks, block_size)
        return num_blocks * self.kv_block_bytes(block_size)

    @torch.inference_mode()
    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Copies device block device_blocks[i] to host block host_blocks[i], in every layer."""
        self._copy_blocks(self._caches(), device_blocks, self._caches(host=True), host_blocks)

    @torch.inference_mode()
    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copies host block host_blocks[i] to device block device_blocks[i], in every layer."""
        self._copy_blocks(self._caches(host=True), host_blocks, self._caches(), device_blocks)

    def _caches(self, host: bool = False) -> list[tuple[torch.Tensor, int]]:
        """Every cache tensor (or swap space) with the dim its blocks are on (the model's kv_block_dim: 1
        for K/V caches, 0 for an MLA latent), the draft model's after the target's; once each, where layer
        groups share them (common/kv_cache_spec.py)."""
        own = [(t, self.model.kv_block_dim) for t in (self.host_kv_caches if host else self.kv_caches)]
        if self.draft is not None:
            dim = self.draft.model.kv_block_dim
            own += [(t, dim) for t in (self.draft.host_kv_caches if host else self.draft.kv_caches)]
        return list({id(t): (t, d) for t, d in own}.values())

    def _copy_blocks(self, src: list[tuple], src_blocks, dst: list[tuple], dst_blocks) -> None:
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
        if not src_blocks:
            return
        src_index = torch.tensor(src_blocks, dtype=torch.long, device=src[0][0].device)
        dst_index = torch.tensor(dst_blocks, dtype=torch.long, device=dst[0][0].device)
        for (s, dim), (d, _) in zip(src, dst, strict=True):
            # One gather on the source side, one transfer, one scatter on the destination side per layer.
            # Synchronous, so a swap out is complete before the forward reuses its device blocks.
            as_bits(d).index_copy_(dim, dst_index, as_bits(s).index_select(dim, src_index).to(d.device))

    def warm_up(self, block_size: int) -> None:
        """Runs the steps a first request brings (warm_up_steps), sampled greedily and by a draw, so that
        none of it compiles or initialises on a request's path; first waits for the kernels compiled
        while the weights loaded (warm_kernels). profile_num_blocks does this on CUDA; a worker that
        does not profile calls this before serving."""
        if self.kernel_warm_up is not None:
            self.kernel_warm_up.wait()
        for lens in warm_up_steps(block_size, self.config.max_position_embeddings):
            self.run_synthetic(lens, block_size)
        if self.sampler is not None and self.sampler.grammar is not None:
            self.sampler.grammar.compiler.wait_started()  # its tokenizer: not beside a first request

    def run_synthetic(self, lens: list[tuple[int, int]], block_size: int) -> float:
        """Runs a synthetic_step on a scratch cache, sampled greedily and by a draw in turn: its forward's
        seconds (warm_up; shard_worker/warm_up.py measure_speed times them)."""
        configs = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.7, top_p=0.9, top_k=50)]
        step, num_blocks = synthetic_step(lens, block_size, sample=True)
        with self._scratch_cache(num_blocks, block_size), torch.inference_mode():
            states = None
            if self.sampler is not None:
                # A prompt (q == c) has sampled nothing yet; a decode has sampled its last token.
                states = [
                    self.sampler.new_state(
                        SequenceInit(
                            seq_id=i,
                            sampling=configs[i % len(configs)],
                            top_logprobs=0,
                            token_ids=[0] * c,
                            num_prompt_tokens=c if q == c else c - 1,
                            num_sampled=0 if q == c else 1,
                        )
                    )
                    for i, (q, c) in enumerate(lens)
                ]
            seconds = self.execute(step, states).forward_seconds
            for state in states or ():
                self.sampler.release(state)
        return seconds

    def _dummy_step(
        self,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        memory: CudaMemory | None = None,
    ) -> int:
        """Runs the worst step (worst_step), then warm_up, so both attention tilings are compiled whatever
        the limits. Returns the bytes the step needed beyond what was allocated when it began (weights
        and its own scratch KV cache, which the real cache replaces): 0 without `memory`."""
        worst, num_blocks = worst_step(block_size, max_num_batched_tokens, max_num_seqs, max_model_len)
        with self._scratch_cache(num_blocks, block_size), torch.inference_mode():
            allocated = 0
            if memory is not None:
                allocated = memory.allocated()
                memory.reset_peak()
            self.execute(worst)
            # Its logits, one row per sequence (each samples at least one token), and the sampler's
            # temporaries.
            hidden = torch.zeros(len(worst.seq_ids), self.config.hidden_size)
            logits = self.model.compute_logits(hidden.to(self.device, self.dtype))
            if logits is not None:
                torch.log_softmax(logits.float(), dim=-1).sort(dim=-1)
            peak = 0 if memory is None else memory.max_allocated() - allocated
        self.warm_up(block_size)
        return peak

    @contextlib.contextmanager
    def _scratch_cache(self, num_blocks: int, block_size: int) -> Iterator[None]:
        saved = self.kv_caches, self.block_size, self.num_kv_blocks
        saved_draft = self.draft.kv_caches if self.draft is not None else None
        self.allocate_kv_cache(num_blocks, block_size)
        try:
            yield
        finally:
            self.kv_caches, self.block_size, self.num_kv_blocks = saved
            if self.draft is not None:
                self.draft.kv_caches, self.draft.block_size, self.draft.num_blocks = saved_draft, *saved[1:]
