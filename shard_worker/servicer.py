"""The shard worker's gRPC servicer, thin around one Worker (shard_worker/worker.py): it decodes a
StepRequest into plain values (shard_worker/step.py), runs Worker.step, and encodes the StepResponse;
Describe sizes the KV cache, warms the kernels and measures the speed, InitCache allocates it. Which
scheduler may drive the rank is the lease's (shard_worker/lease.py); the LoRA calls are
shard_worker/lora_service.py's. The process around it is shard_worker/server.py's."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import grpc
import numpy as np
import torch

from common import tracing
from common.grpc_util import SCHEDULER_EPOCH_KEY, SCHEDULER_METADATA_KEY
from common.pb.tpserve.internal.v1 import worker_pb2, worker_pb2_grpc
from common.sampling import SamplingConfig
from shard_worker.config import StepThreads, WorkerConfig
from shard_worker.images import PromptImage
from shard_worker.lease import Caller, Lease, LeaseRefused
from shard_worker.lora_service import LoRAService, lora_settings
from shard_worker.metrics import WorkerMetrics
from shard_worker.startup import StartupPhases, compile_counts, remember_vec_isa
from shard_worker.step import SequenceInit, WorkerStep
from shard_worker.warm_up import SPEED_PROMPT_TOKENS, measure_speed
from shard_worker.worker import Worker

log = logging.getLogger("tpserve.shard_worker")


def _array(data: bytes) -> np.ndarray:
    """A packed little-endian int64 field of a StepRequest (see worker.proto)."""
    return np.frombuffer(data, dtype="<i8")


def caller_of(context) -> Caller:
    """The calling scheduler's name and epoch, from its metadata (scheduler/workers.py)."""
    found = dict(context.invocation_metadata() or ())
    epoch = found.get(SCHEDULER_EPOCH_KEY, "0")
    return Caller(found.get(SCHEDULER_METADATA_KEY, ""), int(epoch) if epoch.isdigit() else 0)


def worker_step(req: worker_pb2.StepRequest) -> WorkerStep:
    """The StepRequest as plain values."""
    return WorkerStep(
        step_id=req.step_id,
        new_sequences=[sequence_init(m) for m in req.new_sequences],
        forgotten_seq_ids=list(req.forgotten_seq_ids),
        swap_out=(list(req.swap_out_src), list(req.swap_out_dst)),
        swap_in=(list(req.swap_in_src), list(req.swap_in_dst)),
        seq_ids=_array(req.seq_ids),
        query_lens=_array(req.query_lens),
        context_lens=_array(req.context_lens),
        sample_counts=_array(req.sample_counts),
        input_ids=_array(req.input_ids),
        table_reset=_array(req.table_reset),
        new_block_counts=_array(req.new_block_counts),
        new_block_ids=_array(req.new_block_ids),
        group_new_block_ids=_array(req.group_new_block_ids),
        state_slots=_array(req.state_slots) if req.state_slots else None,
        state_swap_out=(list(req.state_swap_out_src), list(req.state_swap_out_dst)),
        state_swap_in=(list(req.state_swap_in_src), list(req.state_swap_in_dst)),
        grammar_wait_ms=req.grammar_wait_ms,
        prompt_logprob_counts=_array(req.prompt_logprob_counts) if req.prompt_logprob_counts else None,
        draft_counts=_array(req.draft_counts) if req.draft_counts else None,
    )


def sequence_init(msg: worker_pb2.SequenceInit) -> SequenceInit:
    return SequenceInit(
        seq_id=msg.seq_id,
        sampling=SamplingConfig.from_proto(msg.sampling),
        top_logprobs=msg.top_logprobs,
        token_ids=list(msg.token_ids),
        num_prompt_tokens=msg.num_prompt_tokens,
        num_sampled=msg.num_sampled,
        stop_token_ids=tuple(msg.stop_token_ids),
        want_prompt_logprobs=msg.want_prompt_logprobs,
        prompt_logprobs=msg.prompt_logprobs,
        lora_name=msg.lora_name,
        pooling=msg.pooling,
        token_type_start=msg.token_type_start,
        images=tuple(
            PromptImage(
                im.offset,
                im.length,
                im.hash,
                np.frombuffer(im.pixel_values, dtype="<f4").reshape(tuple(im.pixel_shape)),
            )
            for im in msg.images
        ),
    )


class ShardWorkerServicer(LoRAService, worker_pb2_grpc.ShardWorkerServicer):
    def __init__(
        self, runner, config: WorkerConfig, metrics: WorkerMetrics, phases: StartupPhases | None = None
    ):
        """phases: this rank's start-up so far (loading); Describe adds sizing and warm-up to it."""
        self.runner = runner
        self.phases = phases if phases is not None else StartupPhases(config.rank)
        self.config = config
        self.metrics = metrics
        self._tracer = tracing.tracer("tpserve.shard_worker")
        # A failure of the rank itself (not of a stream): its process group may be broken, so the rank
        # must exit for the launcher or Kubernetes to rebuild the group. serve() sets this.
        self.on_failure = lambda reason: None
        # One step stream at a time: a second at once would interleave steps.
        self._step_lock = threading.Lock()
        # Held by each step and by Describe/InitCache: a scheduler that reconnects after a step timeout
        # must not profile memory or allocate a cache while the old forward still runs. The lease (which
        # scheduler drives this worker, lease.py) is taken and checked under it, so a call that waited
        # for it is judged by who holds the worker when it runs.
        self._device_lock = threading.Lock()
        self.lease = Lease()
        # The sequences the scheduler told this rank about, and the steps it runs (shard_worker/worker.py).
        # On CPU, torch's threads are sized per step (config.StepThreads).
        threads = None
        if runner.device.type == "cpu":
            threads = StepThreads(config.threads, config.big_step_threads, torch.set_num_threads)
        runner.model.share_kv_tensors = True  # every step sends each layer group's table (worker.py)
        self.worker = Worker(runner, threads)

    def Describe(self, request, context):
        with self._device_lock:
            self._take_lease(context, "describe")
            with self._failing_on_error("describing its capacity"):
                response = self._describe(request)
            self.lease.renew(caller_of(context))  # a Describe that profiled for minutes: from its end
            return response

    def _take_lease(self, context, what: str) -> None:
        """FAILED_PRECONDITION naming the holder when another scheduler holds this worker: its Describe
        would drop the KV caches, its InitCache every sequence, of the one starting or stepping it. The
        same scheduler reconnecting (after a step timeout) goes on. Called under the device lock."""
        try:
            self.lease.take(caller_of(context), what)
        except LeaseRefused as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def _describe(self, request) -> worker_pb2.DescribeResponse:
        info = self.runner.describe()
        # CUDA sizes its cache from the worst step's memory peak, which warms the kernels too; a CPU
        # cache is the host budget, and the kernels are warmed with the shapes requests bring.
        profiling = not request.num_kv_blocks and self.runner.device.type == "cuda"
        kernels = self.runner.kernel_warm_up
        if kernels is not None and "compile_kernels" not in self.phases.seconds:
            waited = kernels.wait()  # compiling since the layers were built, beside load_weights
            note = f"beside load_weights, {waited:.2f}s of it after; {self.phases.compile_note()}"
            self.phases.record("compile_kernels", kernels.seconds, note)
        with self.phases.phase("kv_sizing", self.phases.compile_note if profiling else lambda: ""):
            # A fixed count is the bytes of that many blocks of every layer: a model with layer groups
            # (common/kv_cache_spec.py) has blocks of fewer layers, and more of them in those bytes.
            model = self.runner.model
            fixed = request.num_kv_blocks * model.num_kv_layers // model.num_kv_caches
            num_blocks = fixed or self.runner.profile_num_blocks(
                block_size=request.block_size,
                max_num_batched_tokens=request.max_num_batched_tokens,
                gpu_memory_utilization=request.gpu_memory_utilization,
                cpu_kv_cache_gib=request.cpu_kv_cache_gib,
                max_num_seqs=request.max_num_seqs,
                max_model_len=request.max_model_len or None,
            )
            if fixed:  # the blocks asked for, and a state slot for each sequence a step may carry
                self.runner.num_state_slots = (request.max_num_seqs or 1) if info["state_slot_bytes"] else 0
        if not profiling:
            with self.phases.phase("warm_up", self.phases.compile_note):
                self.runner.warm_up(request.block_size)
            remember_vec_isa(self.phases.cache_dir)  # the kernels built: the probe's answer was right
        with self.phases.phase("measure_speed"):  # for the router's admission from the first request
            speed = measure_speed(
                lambda lens: self.runner.run_synthetic(lens, request.block_size),
                request.max_num_seqs or 1,
                request.max_num_batched_tokens or SPEED_PROMPT_TOKENS,
                request.max_model_len or info["max_position_embeddings"],
            )
        for name, seconds in self.phases.seconds.items():
            self.metrics.startup.labels(phase=name).set(seconds)
        compiled, cached = compile_counts()
        response = worker_pb2.DescribeResponse(
            rank=self.config.rank,
            world_size=self.config.world_size,
            model_name=info["model_name"],
            vocab_size=info["vocab_size"],
            max_position_embeddings=info["max_position_embeddings"],
            eos_token_ids=info["eos_token_ids"],
            num_kv_blocks=num_blocks,
            weight_bytes=info["weight_bytes"],
            device=f"{self.runner.device} {str(self.runner.dtype).removeprefix('torch.')}"
            + (
                f", KV cache {str(self.runner.kv_dtype)[6:]}"
                if self.runner.kv_dtype != self.runner.dtype
                else ""
            ),
            kv_block_bytes=self.runner.kv_block_bytes(request.block_size),
            draft_model_name=info["draft_model_name"],
            layer_windows=info["layer_windows"],
            layer_latent_dims=info["layer_latent_dims"],
            state_slot_bytes=info["state_slot_bytes"],
            num_state_slots=self.runner.num_state_slots,
            startup_phases=[
                worker_pb2.StartupPhase(name=n, seconds=t) for n, t in self.phases.seconds.items()
            ],
            compiled_graphs=compiled,
            cached_graphs=cached,
            runner=info["runner"],
            embedding_size=info["embedding_size"],
            cross_encoder=info["cross_encoder"],
            **lora_settings(self.config),
        )
        speed.fill(response)
        return response

    def InitCache(self, request, context):
        with self._device_lock:
            self._take_lease(context, "allocate the cache of")
            with self._failing_on_error("allocating its KV cache"):
                response = self._init_cache(request)
            self.lease.renew(caller_of(context))  # CUDA graphs may take minutes to capture
            return response

    def _init_cache(self, request) -> worker_pb2.InitCacheResponse:
        start = time.perf_counter()
        with self.phases.phase("kv_allocate"):
            nbytes, host_bytes = self.worker.init_cache(
                request.num_blocks,
                request.block_size,
                request.num_host_blocks,
                request.max_model_len,
                request.max_num_seqs,
                request.num_state_slots,
                request.num_host_state_slots,
            )
        self.metrics.startup.labels(phase="kv_allocate").set(self.phases.seconds["kv_allocate"])
        log.info(
            "rank %d: KV cache of %d blocks, %.1f MiB; swap space of %d blocks, %.1f MiB",
            self.config.rank,
            request.num_blocks,
            nbytes / 2**20,
            request.num_host_blocks,
            host_bytes / 2**20,
        )
        if self.runner.graphs is not None:
            log.info(
                "rank %d: decode CUDA graphs for batch sizes %s; InitCache took %.1fs",
                self.config.rank,
                ",".join(map(str, self.runner.graphs.sizes)),
                time.perf_counter() - start,
            )
        return worker_pb2.InitCacheResponse(kv_cache_bytes=nbytes, host_kv_cache_bytes=host_bytes)

    def Step(self, request_iterator, context):
        caller, refused = caller_of(context), None
        if not self._step_lock.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{self.lease.holder} is already stepping this worker"
            )
        try:
            with self._device_lock:
                try:
                    self.lease.start_stepping(caller)
                except LeaseRefused as e:
                    refused = str(e)
            for req in () if refused else request_iterator:
                with self._device_lock:
                    if not self.lease.holds(caller):  # its restart took the worker over
                        refused = f"{self.lease.holder} took this worker over; {caller} may not step it"
                        break
                    resp = self._step(req)
                yield resp
        except grpc.RpcError:
            # The scheduler closed or cancelled the stream (it stopped, restarted or gave this group
            # up): not a failure of this rank; the next scheduler opens a new stream.
            log.info("rank %d: the scheduler's step stream ended", self.config.rank)
        except Exception as e:
            self.on_failure(f"step failed: {type(e).__name__}: {e}")
            raise
        finally:
            with self._device_lock:
                self.lease.stop_stepping(caller)
            self._step_lock.release()
        if refused is not None:  # out of the try: an abort is no failure of this rank
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)

    @contextlib.contextmanager
    def _failing_on_error(self, what: str):
        try:
            yield
        except Exception as e:
            self.on_failure(f"{what} failed: {type(e).__name__}: {e}")
            raise

    def _step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        step = worker_step(req)
        parent = tracing.context_from_carrier(req.trace_context)
        if parent is None:
            out = self.worker.step(step)
        else:
            with self._tracer.start_as_current_span("shard_worker.forward", context=parent) as span:
                out = self.worker.step(step)
                span.set_attributes(
                    {
                        "tpserve.rank": self.config.rank,
                        "tpserve.batch_size": len(step.seq_ids),
                        "tpserve.batch_tokens": len(step.input_ids),
                        "tpserve.allreduce_seconds": out.allreduce_seconds,
                    }
                )
        self.metrics.forward.observe(out.forward_seconds)
        self.metrics.allreduce.observe(out.allreduce_seconds)
        if out.grammar_mask_seconds:
            self.metrics.grammar_mask.observe(out.grammar_mask_seconds)
            self.metrics.grammar_fill.observe(out.grammar_fill_seconds)
        return worker_pb2.StepResponse(
            step_id=req.step_id,
            token_counts=out.token_counts,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            top_token_ids=out.top_token_ids,
            top_logprobs=out.top_logprobs,
            forward_seconds=out.forward_seconds,
            allreduce_seconds=out.allreduce_seconds,
            grammar_ready_seq_ids=out.grammar_ready_seq_ids,
            grammar_errors=[worker_pb2.GrammarError(seq_id=i, message=m) for i, m in out.grammar_errors],
            lora_errors=[worker_pb2.LoRAError(lora_name=n, message=m) for n, m in out.lora_errors],
            prompt_logprobs=out.prompt_logprobs,
            prompt_ranks=out.prompt_ranks,
            prompt_top_token_ids=out.prompt_top_token_ids,
            prompt_top_logprobs=out.prompt_top_logprobs,
            pooled=out.pooled,
            pooled_seq_ids=out.pooled_seq_ids,
        )
