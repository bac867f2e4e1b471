"""Runs this rank's shard of the model for one scheduled step: flat arrays in, sampled tokens out.

Every rank runs the same forward on the same StepInputs, so every rank issues the same collectives in
the same order; only rank 0 samples. The runner decides nothing: which tokens to compute, and where
their KV goes, come from the scheduler (the step's lengths and the block tables the worker keeps).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from common.sampling import SamplingConfig
from shard_worker.attention import Attention, StepBatch, select_backend
from shard_worker.attention.kv_dtype import as_bits
from shard_worker.capacity import CudaMemory, kv_budget, synthetic_step, worst_step
from shard_worker.cuda_graphs import CudaGraphRunner, capture_bytes, graphs_unsupported
from shard_worker.draft import DraftModel
from shard_worker.model.loader import load_model
from shard_worker.model.lora import LoRAAdapters, check_lora, lora_batch, step_lora_batch
from shard_worker.model.quant import base, cpu_linear
from shard_worker.parallel import TensorParallel
from shard_worker.sampling import Sampler, SequenceState
from shard_worker.sampling.grammar import GrammarCompiler
from shard_worker.sampling.rows import prompt_logprobs, sampled_rows, step_proposals
from shard_worker.step import SequenceInit, StepInputs, StepOutputs
from shard_worker.warm_up import KernelWarmUp, warm_up_steps

log = logging.getLogger("tpserve.shard_worker")


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel,
        load_format: str = "auto",
        attention_backend: str = "auto",
        cuda_graphs: bool = False,
        speculative_model: str | Path | None = None,
        linear_dtype: torch.dtype | None = None,
        prepack_linear: bool = True,
        quantization: str | None = None,
        lora: tuple | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        warm_kernels: bool = False,
    ):
        """load_format "auto" reads the checkpoint's weights; "dummy" fills them with small random values
        on the device from config.json alone (vLLM's name), for benchmarks at real shapes.
        attention_backend: see shard_worker/attention (ValueError when it cannot run here).
        cuda_graphs: replay decode steps from graphs (shard_worker/cuda_graphs.py), captured by
        capture_cuda_graphs once the cache exists; on CPU the same path runs without capture (tests).
        speculative_model: a draft model's checkpoint (shard_worker/draft.py), or None.
        linear_dtype: the dtype unquantized linear layers hold their weights in (quant/unquantized.py),
        None for dtype. prepack_linear: on CPU, hold them in our linear kernel's layout (cpu_linear.py)
        or oneDNN's; False only to measure what that gains. quantization: --quantization (int8, fp8: an
        unquantized checkpoint quantized while it loads), None for the checkpoint's own format.
        lora: (--lora-modules, --max-lora-rank[, --max-loras, --max-cpu-loras]) with --enable-lora
        (shard_worker/model/lora), or None.
        kv_cache_dtype: the KV cache's elements (attention/kv_dtype.py), None for dtype.
        warm_kernels: on CPU, compile the attention kernels on a thread while the weights load
        (shard_worker/warm_up.py: a worker's start-up); warm_up waits for it."""
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype or dtype
        unsupported = None
        if speculative_model:
            unsupported = "with a --speculative-model"
        elif torch.device(device).type == "cuda" or attention_backend == "triton":
            unsupported = "on CUDA (the Triton kernel reads caches in the model's dtype)"
        if self.kv_dtype != dtype and unsupported:
            raise ValueError(
                f"--kv-cache-dtype {str(self.kv_dtype)[6:]} is not implemented {unsupported}: "
                "use --kv-cache-dtype auto"
            )
        self.device = torch.device(device)
        self.tp = tp
        if self.device.type == "cpu":
            # Denormal floats make CPU matmuls many times slower, and random or tiny weights produce them.
            torch.set_flush_denormal(True)
            if prepack_linear:  # our linear kernel: a cold start compiles it beside the attention kernel
                cpu_linear.EXT.build_in_background()
        self.attention = select_backend(attention_backend, self.device, dtype)
        self.kernel_warm_up: KernelWarmUp | None = None

        def check(model: torch.nn.Module) -> None:  # the layers exist, their weights do not yet
            self._check_layers(model)
            if warm_kernels and self.device.type == "cpu":
                self.kernel_warm_up = KernelWarmUp(self.attention, model, self.kv_dtype).start()

        try:
            args = (dtype, self.device, tp, load_format, check, linear_dtype, prepack_linear, quantization)
            self.config, self.model = load_model(self.model_dir, *args)
        except BaseException:
            # The warm-up thread runs torch's kernels: a process that exits (here, with the checkpoint's
            # error) while it does aborts in C++ ("terminate called without an active exception").
            if self.kernel_warm_up is not None:
                self.kernel_warm_up.wait()
            raise
        self.lora = None
        if lora is not None:
            modules, max_rank, *slots = lora
            self.lora = LoRAAdapters(self.model, modules, max_rank, dtype, self.device, *slots)
        self.graphs: CudaGraphRunner | None = None
        reason = graphs_unsupported(self.attention, tp.world_size, _nccl_version()) if cuda_graphs else None
        if reason is not None:
            log.warning("rank %d: no CUDA graphs: %s", tp.rank, reason)
        self.cuda_graphs = cuda_graphs and reason is None
        # The padding rows of graph buckets write their keys to a block of their own: the cache's last,
        # one more than the scheduler is told of (profile_num_blocks, allocate_kv_cache).
        self.reserved_blocks = 1 if self.cuda_graphs else 0
        self.draft = None
        if speculative_model:
            self.draft = DraftModel(
                speculative_model,
                dtype,
                self.device,
                tp,
                self.attention,
                self.config,
                self._check_layers,
                linear_dtype,
            )
        self.kv_caches: list[torch.Tensor] = []
        # Swap space: the same layout as kv_caches, in host memory (pinned on CUDA, for fast copies).
        self.host_kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.sampler = None
        if tp.rank == 0:
            grammars = GrammarCompiler(self.model_dir, self.config.vocab_size, self.config.eos_token_ids)
            grammars.start()
            self.sampler = Sampler(self.config.vocab_size, self.device, self.config.eos_token_ids, grammars)

    def describe(self) -> dict:
        return {
            "model_name": self.model_dir.resolve().name,
            "vocab_size": self.config.vocab_size,
            "max_position_embeddings": self.config.max_position_embeddings,
            "eos_token_ids": list(self.config.eos_token_ids),
            "weight_bytes": base.weight_bytes(self.model),
            "draft_model_name": self.draft.name if self.draft is not None else "",
            "layer_windows": self.model.layer_windows(),
        }

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one KV block takes on this rank, over all layers (the draft model's block of the same id
        included: the two caches are allocated, swapped and freed together)."""
        per_cache = math.prod(self.model.kv_cache_shape(1, block_size)) * self.kv_dtype.itemsize
        draft = self.draft.kv_block_bytes(block_size) if self.draft is not None else 0
        return self.model.num_kv_caches * per_cache + draft

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
        num_blocks = budget // per_block - self.reserved_blocks
        if num_blocks < 1:
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
        if self.draft is not None:
            self.draft.allocate(total, block_size)
        return total * self.kv_block_bytes(block_size)

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

    def _caches(self, host: bool = False) -> list[torch.Tensor]:
        """Every layer's cache (or swap space), the draft model's after the target's."""
        draft = [] if self.draft is None else self.draft.host_kv_caches if host else self.draft.kv_caches
        return list({id(t): t for t in (self.host_kv_caches if host else self.kv_caches) + draft}.values())

    def _copy_blocks(self, src: list[torch.Tensor], src_blocks, dst: list[torch.Tensor], dst_blocks) -> None:
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
        if not src_blocks:
            return
        src_index = torch.tensor(src_blocks, dtype=torch.long, device=src[0].device)
        dst_index = torch.tensor(dst_blocks, dtype=torch.long, device=dst[0].device)
        for s, d in zip(src, dst, strict=True):
            # One gather on the source side, one transfer, one scatter on the destination side per layer.
            # Synchronous, so a swap out is complete before the forward reuses its device blocks.
            as_bits(d).index_copy_(1, dst_index, as_bits(s).index_select(1, src_index).to(d.device))

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, states: list[SequenceState] | None = None) -> StepOutputs:
        """Runs the step; on rank 0 samples the sequences with sample_counts > 0, whose sampling states
        `states` holds in batch order."""
        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before execute")
        if not len(inputs.seq_ids):
            return StepOutputs()  # the same on every rank, so no rank is left waiting in a collective
        start = time.perf_counter()
        self.tp.take_comm_seconds()  # count only this step's communication
        self._check(inputs)
        draft_probs = None
        if self.draft is not None:  # the draft's proposals join the step's tokens (draft_counts)
            inputs, draft_probs = self.draft.propose(inputs, states)
        elif inputs.draft_counts.any():
            raise ValueError("the step asks for draft tokens, and this worker has no --speculative-model")
        batch = StepBatch.build(
            inputs.input_ids,
            inputs.query_lens,
            inputs.context_lens,
            inputs.block_table,
            self.block_size,
            self.device,
            inputs.group_block_tables,
        )
        if states:
            self.sampler.prepare(states)  # host work for the sampler, overlapping the forward
        lora = step_lora_batch(self.lora, inputs)
        # Graphs were captured without adapters: a step with adapter rows runs eagerly.
        hidden = self.graphs.replay(batch) if self.graphs is not None and lora is None else None
        if hidden is None:  # not a decode step that fits a bucket, or no graphs
            ctx = self.attention.context(batch)
            with lora_batch(lora):
                hidden = self.model(batch.input_ids, batch.positions, ctx, self.kv_caches)

        out = StepOutputs()
        if inputs.prompt_rows is not None and len(inputs.prompt_rows):
            prompt_logprobs(self.model, hidden, inputs, out)
        sampled = np.flatnonzero(inputs.sample_counts)
        if len(sampled):
            counts = inputs.sample_counts[sampled]
            rows = sampled_rows(np.cumsum(inputs.query_lens)[sampled], counts)
            logits = self.model.compute_logits(hidden.index_select(0, torch.from_numpy(rows).to(self.device)))
            if logits is not None:
                if states is None or len(states) != len(sampled):
                    raise ValueError(
                        f"{len(sampled)} sequences sample, {len(states or ())} sampling states given"
                    )
                proposals = step_proposals(inputs.input_ids, rows, counts)
                result = self.sampler.sample(states, counts.tolist(), proposals, logits, draft_probs)
                out.token_counts, out.token_ids = result.token_counts, result.token_ids
                out.logprobs, out.top_token_ids, out.top_logprobs = (
                    result.logprobs,
                    result.top_token_ids,
                    result.top_logprobs,
                )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out.allreduce_seconds = self.tp.take_comm_seconds()
        out.forward_seconds = time.perf_counter() - start
        return out

    def check_lora(self, name: str) -> None:
        check_lora(self.lora, name)

    def _check(self, inputs: StepInputs) -> None:
        num_seqs = len(inputs.seq_ids)
        for name in ("query_lens", "context_lens", "sample_counts", "block_table"):
            if len(getattr(inputs, name)) != num_seqs:
                raise ValueError(f"{name} has {len(getattr(inputs, name))} entries for {num_seqs} sequences")
        if num_seqs and bool((inputs.sample_counts > inputs.query_lens).any()):
            raise ValueError("a sequence samples more positions than it computes this step")
        if num_seqs and int(inputs.context_lens.max()) > self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(inputs.context_lens.max()) - 1} is beyond max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )

    def warm_up(self, block_size: int) -> None:
        """Runs the steps a first request brings (warm_up_steps), sampled greedily and by a draw, so that
        none of it compiles or initialises on a request's path; first waits for the kernels compiled
        while the weights loaded (warm_kernels). profile_num_blocks does this on CUDA; a worker that
        does not profile calls this before serving."""
        if self.kernel_warm_up is not None:
            self.kernel_warm_up.wait()
        steps = warm_up_steps(block_size, self.config.max_position_embeddings)
        configs = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.7, top_p=0.9, top_k=50)]
        for lens in steps:
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
                self.execute(step, states)
                for state in states or ():
                    self.sampler.release(state)
        if self.sampler is not None and self.sampler.grammar is not None:
            self.sampler.grammar.compiler.wait_started()  # its tokenizer: not beside a first request

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
        saved_caches, saved_block_size = self.kv_caches, self.block_size
        saved_draft = self.draft.kv_caches if self.draft is not None else None
        self.allocate_kv_cache(num_blocks, block_size)
        try:
            yield
        finally:
            self.kv_caches, self.block_size = saved_caches, saved_block_size
            if self.draft is not None:
                self.draft.kv_caches, self.draft.block_size = saved_draft, saved_block_size

    def _check_layers(self, model: torch.nn.Module) -> None:
        """Refuses a model whose attention layers the backend cannot run (before its weights load)."""
        for name, layer in model.named_modules():
            reason = self.attention.refusal(layer) if isinstance(layer, Attention) else None
            if reason is not None:
                raise ValueError(f"--attention-backend {self.attention.name}: {name}: {reason}")


def _nccl_version() -> tuple[int, ...]:
    try:
        return tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):  # a build without NCCL (CPU)
        return (0,)
