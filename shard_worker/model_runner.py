"""Runs this rank's shard of the model for one scheduled step: flat arrays in, sampled tokens out.

Every rank runs the same forward on the same StepInputs, so every rank issues the same collectives in
the same order; only rank 0 samples. The runner decides nothing: which tokens to compute, and where
their KV goes, come from the scheduler (the step's lengths and the block tables the worker keeps).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from common.pooling import pooling_config
from shard_worker.attention import Attention, StepBatch, select_backend
from shard_worker.attention.latent import LatentAttention
from shard_worker.cuda_graphs import CudaGraphRunner, graphs_unsupported
from shard_worker.draft import DraftModel
from shard_worker.encoder_cache import EncoderCache
from shard_worker.images import step_images
from shard_worker.model.layers.gated_deltanet import StateStep
from shard_worker.model.loader import load_model
from shard_worker.model.lora import LoRAAdapters, check_lora, lora_batch, step_lora_batch
from shard_worker.model.quant import base, cpu_linear
from shard_worker.mrope import step_positions
from shard_worker.parallel import TensorParallel
from shard_worker.pooling import Pooler
from shard_worker.runner_caches import RunnerCaches
from shard_worker.sampling import Sampler, SequenceState
from shard_worker.sampling.grammar import GrammarCompiler
from shard_worker.sampling.rows import prompt_logprobs, sampled_rows, step_proposals
from shard_worker.step import StepInputs, StepOutputs
from shard_worker.warm_up import KernelWarmUp

log = logging.getLogger("tpserve.shard_worker")

# The vision encoder's outputs kept by image hash (beyond those a running sequence still needs): one of
# Gemma 3 4B's images is 256 x 2560 floats, 2.6 MB in float32, so about a hundred pictures.
ENCODER_CACHE_BYTES = 256 * 2**20


class ModelRunner(RunnerCaches):
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
        runner: str = "generate",
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
        (shard_worker/warm_up.py: a worker's start-up); warm_up waits for it. runner: generate, or
        pooling (resolved by common/pooling.py): rank 0 pools the sequences that ask (pooling.py)."""
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
            # Served for pooling, the model never decodes: every product has a whole prompt's rows.
            self.config, self.model = load_model(self.model_dir, *args, prompts_only=runner == "pooling")
        except BaseException:
            # The warm-up thread runs torch's kernels: a process that exits (here, with the checkpoint's
            # error) while it does aborts in C++ ("terminate called without an active exception").
            if self.kernel_warm_up is not None:
                self.kernel_warm_up.wait()
            raise
        self.pooler = None
        if runner == "pooling":
            self.pooler = Pooler(pooling_config(self.model_dir), self.model, self.model_dir)
        # A model that takes images (encode_images) keeps its vision encoder's outputs by image hash.
        takes_images = hasattr(self.model, "encode_images")
        self.encoder_cache = EncoderCache(ENCODER_CACHE_BYTES) if takes_images else None
        self.lora = None
        if lora is not None:
            modules, max_rank, *slots = lora
            self.lora = LoRAAdapters(self.model, modules, max_rank, dtype, self.device, *slots)
        self.graphs: CudaGraphRunner | None = None
        has_state = getattr(self.model, "has_state", False)
        if has_state and speculative_model:
            raise ValueError(
                "--speculative-model: the model has linear-attention layers, whose state cannot take back "
                "rejected proposals"
            )
        reason = graphs_unsupported(self.attention, tp.world_size, _nccl_version()) if cuda_graphs else None
        if cuda_graphs and reason is None and has_state:
            reason = "linear-attention layers keep a per-sequence state the decode graphs do not carry"
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
        # Linear-attention layers' state slots (per layer: conv, delta), and their swap space.
        self.state_caches: list = []
        self.host_state_caches: list = []
        self.num_state_slots = 0  # what profile_num_blocks gave them of the budget
        self.kv_caches: list[torch.Tensor] = []
        # Swap space: the same layout as kv_caches, in host memory (pinned on CUDA, for fast copies).
        self.host_kv_caches: list[torch.Tensor] = []
        self.block_size = self.num_kv_blocks = 0
        self.sampler = None
        if tp.rank == 0:
            grammars = GrammarCompiler(self.model_dir, self.config.vocab_size, self.config.eos_token_ids)
            if self.pooler is None:  # a pooling model samples nothing: no grammar tokenizer to build
                grammars.start()
            self.sampler = Sampler(self.config.vocab_size, self.device, self.config.eos_token_ids, grammars)

    def describe(self) -> dict:
        pooler, positions = self.pooler, self.config.max_position_embeddings
        if pooler is not None and pooler.config.max_seq_length:  # sentence-transformers' input cap
            positions = min(positions, pooler.config.max_seq_length)
        return {
            "model_name": self.model_dir.resolve().name,
            "vocab_size": self.config.vocab_size,
            "max_position_embeddings": positions,
            "runner": "generate" if pooler is None else "pooling",
            "embedding_size": 0 if pooler is None else pooler.size,
            "cross_encoder": pooler is not None and pooler.config.cross_encoder,
            "eos_token_ids": list(self.config.eos_token_ids),
            "weight_bytes": base.weight_bytes(self.model),
            "draft_model_name": self.draft.name if self.draft is not None else "",
            "layer_windows": self.model.layer_windows(),
            "layer_latent_dims": self.model.layer_latent_dims(),
            "state_slot_bytes": self.state_slot_bytes(),
        }

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
        images = None
        if self.encoder_cache is not None:
            images = step_images(inputs, self.encoder_cache, self.model.encode_images, self.device)
        batch = StepBatch.build(
            inputs.input_ids,
            inputs.query_lens,
            inputs.context_lens,
            inputs.block_table,
            self.block_size,
            self.device,
            num_blocks=self.num_kv_blocks,
            group_tables=inputs.group_block_tables,
            image_spans=images.spans if images is not None else (),
        )
        if states:
            self.sampler.prepare(states)  # host work for the sampler, overlapping the forward
        lora = step_lora_batch(self.lora, inputs)
        positions = self._mrope_positions(inputs, batch.positions)
        # Graphs were captured without adapters, and with one position a token: such steps run eagerly.
        eager = lora is not None or positions is not batch.positions
        hidden = self.graphs.replay(batch) if self.graphs is not None and not eager else None
        if hidden is None:  # not a decode step that fits a bucket, or no graphs
            ctx = self.attention.context(batch)
            types = inputs.token_type_ids  # a cross-encoder's pairs (pooling.py)
            extra = {} if types is None else {"token_type_ids": torch.from_numpy(types).to(self.device)}
            if images is not None:
                extra["images"] = images
            if getattr(self.model, "has_state", False):  # linear attention: each sequence's state slot
                extra["state_step"] = StateStep.build(
                    inputs.query_lens, inputs.context_lens, inputs.state_slots, self.device
                )
                extra["state_caches"] = self.state_caches
            with lora_batch(lora):
                hidden = self.model(batch.input_ids, positions, ctx, self.kv_caches, **extra)

        out = StepOutputs(lora_errors=self.lora.take_errors() if self.lora is not None else [])
        if inputs.pool_index is not None and self.pooler is not None and self.tp.rank == 0:
            out.pooled = self.pooler.pool(hidden, inputs.query_lens, inputs.pool_index)
            out.pooled_seq_ids = inputs.seq_ids[inputs.pool_index].tolist()
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

    def _mrope_positions(self, inputs: StepInputs, positions: torch.Tensor) -> torch.Tensor:
        """[3, T] M-RoPE positions when a sequence of the step has a table (a Qwen VL prompt with
        images: shard_worker/mrope.py); else the step's positions as they are."""
        tables = [getattr(seq, "mrope", None) for seq in inputs.sequences or ()]
        if not any(t is not None for t in tables):
            return positions
        rows = step_positions(inputs.query_lens, inputs.context_lens, tables)
        return torch.from_numpy(np.ascontiguousarray(rows)).to(self.device)

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

    def _check_layers(self, model: torch.nn.Module) -> None:
        """Refuses a model whose attention layers the backend cannot run (before its weights load)."""
        for name, layer in model.named_modules():
            reason = self.attention.refusal(layer) if isinstance(layer, Attention | LatentAttention) else None
            if reason is not None:
                raise ValueError(f"--attention-backend {self.attention.name}: {name}: {reason}")


def _nccl_version() -> tuple[int, ...]:
    try:
        return tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):  # a build without NCCL (CPU)
        return (0,)
