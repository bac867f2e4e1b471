"""The scheduler's step loop: plan an iteration, send it to every rank, apply the sampled tokens.

Owns the connection to the shard workers and the map from requests to the router streams that
want their tokens. All state changes happen on one asyncio loop, so no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from common import security, tracing
from common.grpc_util import OPTIONS
from common.pb.tpserve.internal.v1 import scheduler_pb2, worker_pb2, worker_pb2_grpc
from common.pb.tpserve.v1 import generation_pb2
from scheduler.batch import StepBuilder, StepPlan
from scheduler.block_manager import BlockManager, blocks_for
from scheduler.config import SchedulerConfig
from scheduler.fallback import FallbackPolicy, ThroughputFallback
from scheduler.metrics import SchedulerMetrics
from scheduler.scheduler import Scheduler, SchedulerOutput, SequenceUpdate
from scheduler.sequence import Sequence
from scheduler.swap import HostBlockPool

log = logging.getLogger("tpserve.scheduler")


class RouterStream:
    """One router's Connect stream, seen from the engine: outputs, shard status and credit go out on it."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.adds_received = 0
        self.queued = 0  # requests the router holds for lack of credit
        self._last_credit: tuple[int, int] | None = None
        self._last_load: tuple | None = None

    def outputs(self, outputs: list[scheduler_pb2.RequestOutput]) -> None:
        self.queue.put_nowait(scheduler_pb2.SchedulerMessage(outputs=outputs))

    def status(self, ready: bool) -> None:
        self.queue.put_nowait(scheduler_pb2.SchedulerMessage(shards_ready=ready))

    def credit(self, window: int) -> None:
        if (window, self.adds_received) != self._last_credit:
            self._last_credit = (window, self.adds_received)
            credit = scheduler_pb2.Credit(window=window, adds_received=self.adds_received)
            self.queue.put_nowait(scheduler_pb2.SchedulerMessage(credit=credit))

    def load(self, report: scheduler_pb2.LoadReport, force: bool = False) -> None:
        """Sends the load report when it changed (step time to the millisecond), or always when forced
        (the heartbeat: the router takes a replica silent for a few seconds for dead)."""
        key = (
            report.waiting,
            report.running,
            report.kv_blocks_free,
            report.kv_blocks_total,
            report.shards_ready,
            round(report.step_seconds, 3),
        )
        if force or key != self._last_load:
            self._last_load = key
            report.adds_received = self.adds_received
            self.queue.put_nowait(scheduler_pb2.SchedulerMessage(load=report))


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class RequestTrace:
    """A traced request's spans in the scheduler: its whole stay, and its wait before the first step."""

    span: object
    queue_span: object | None


@dataclass
class StepTotals:
    """Running sums the benchmark and stats read (mean batch size, time per step)."""

    steps: int = 0
    batched_seqs: int = 0
    batched_tokens: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    allreduce_seconds: float = 0.0


def step_request(plan: StepPlan) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(
        step_id=plan.step_id,
        new_sequences=[
            worker_pb2.SequenceInit(
                seq_id=s.seq_id,
                sampling=s.sampling,
                top_logprobs=s.top_logprobs,
                token_ids=s.token_ids,
                num_prompt_tokens=s.num_prompt_tokens,
                num_sampled=s.num_output_tokens,
            )
            for s in plan.new_sequences
        ],
        finished_seq_ids=plan.forgotten_seq_ids,
        seq_ids=plan.seq_ids,
        query_lens=plan.query_lens,
        context_lens=plan.context_lens,
        do_sample=plan.do_sample,
        input_ids=plan.input_ids,
        positions=plan.positions,
        slot_mapping=plan.slot_mapping,
        block_table_lens=plan.block_table_lens,
        block_tables=plan.block_tables,
        swap_out_src=plan.swap_out_src,
        swap_out_dst=plan.swap_out_dst,
        swap_in_src=plan.swap_in_src,
        swap_in_dst=plan.swap_in_dst,
    )


class Engine:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.ready = asyncio.Event()
        self.scheduler: Scheduler | None = None
        self.model_info: generation_pb2.ModelInfo | None = None
        self.totals = StepTotals()
        self._recent_steps: deque[float] = deque(maxlen=8)  # seconds per step, for the load reports
        self._builder = StepBuilder(config.block_size)
        self._sinks: dict[str, RouterStream] = {}  # request id -> the stream that wants its tokens
        self._routers: set[RouterStream] = set()
        self._wakeup = asyncio.Event()
        self._next_seq_id = 0
        self._pending_forget: list[int] = []
        self._streams: list = []
        self._channels: list[grpc.aio.Channel] = []
        self.metrics = SchedulerMetrics(self)
        self._tracer = tracing.tracer("tpserve.scheduler")
        self._traces: dict[str, RequestTrace] = {}
        self._status_listeners: set = set()
        self._expiry: asyncio.Task | None = None
        self.fallback = ThroughputFallback(FallbackPolicy()) if config.fallback_static else None

    # ---- workers ----

    async def connect_workers(self) -> None:
        """Agrees the KV capacity with every rank, allocates the caches and opens the step streams."""
        cfg = self.config
        self._channels = [security.aio_channel(addr, cfg.internal_tls, OPTIONS) for addr in cfg.workers]
        stubs = [worker_pb2_grpc.ShardWorkerStub(ch) for ch in self._channels]
        describe = worker_pb2.DescribeRequest(
            block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kv_cache_gib=cfg.cpu_kv_cache_gib,
            max_num_batched_tokens=cfg.policy.max_num_batched_tokens,
        )
        infos = await asyncio.gather(
            *(s.Describe(describe, wait_for_ready=True, timeout=cfg.worker_connect_timeout_s) for s in stubs)
        )
        for rank, info in enumerate(infos):
            if info.rank != rank or info.world_size != len(infos):
                raise RuntimeError(
                    f"worker {cfg.workers[rank]} says it is rank {info.rank} of {info.world_size}, "
                    f"expected rank {rank} of {len(infos)}"
                )
        num_blocks = min(i.num_kv_blocks for i in infos)
        log.info(
            "KV capacity per rank: %s blocks; using the minimum, %d blocks of %d tokens",
            [i.num_kv_blocks for i in infos],
            num_blocks,
            cfg.block_size,
        )
        info = infos[0]
        max_model_len = cfg.policy.max_model_len or info.max_position_embeddings
        if max_model_len > info.max_position_embeddings:
            log.warning(
                "--max-model-len %d is beyond the model's %d positions: capping it",
                max_model_len,
                info.max_position_embeddings,
            )
            max_model_len = info.max_position_embeddings
        # More blocks than max_num_seqs full-length sequences can use would only take memory.
        useful = cfg.policy.max_num_seqs * blocks_for(max_model_len, cfg.block_size)
        if num_blocks > useful:
            log.info("capping the pool at %d blocks: max_num_seqs sequences of max_model_len", useful)
            num_blocks = useful
        if num_blocks * cfg.block_size < max_model_len:
            log.warning(
                "the KV pool holds %d tokens, fewer than max_model_len %d: capping max_model_len",
                num_blocks * cfg.block_size,
                max_model_len,
            )
            max_model_len = num_blocks * cfg.block_size
        # Swap space in blocks: the largest block over ranks, so that every rank's copy fits.
        num_host_blocks = int(cfg.swap_space * 2**30) // max(i.kv_block_bytes for i in infos)
        if cfg.swap_space:
            log.info("swap space: %d host blocks per rank (%.2f GiB)", num_host_blocks, cfg.swap_space)
        init = worker_pb2.InitCacheRequest(
            num_blocks=num_blocks, block_size=cfg.block_size, num_host_blocks=num_host_blocks
        )
        await asyncio.gather(*(s.InitCache(init) for s in stubs))
        blocks = BlockManager(num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        host_blocks = HostBlockPool(num_host_blocks) if num_host_blocks else None
        if self.scheduler is None:
            self.scheduler = Scheduler(
                cfg.resolved_policy(max_model_len), blocks, info.eos_token_ids, host_blocks
            )
        else:  # the ranks came back: same requests, fresh caches
            self.scheduler.replace_blocks(blocks, host_blocks)
        self.model_info = generation_pb2.ModelInfo(
            model_name=info.model_name,
            vocab_size=info.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=info.eos_token_ids,
            tensor_parallel_size=len(infos),
            block_size=cfg.block_size,
        )
        self._streams = [s.Step() for s in stubs]
        self._builder.forget_all()
        log.info(
            "model %s on %d rank(s) (%s), max_model_len %d",
            info.model_name,
            len(infos),
            ", ".join(i.device for i in infos),
            max_model_len,
        )
        self._set_ready(True)

    def _set_ready(self, ready: bool) -> None:
        if ready:
            self.ready.set()
        else:
            self.ready.clear()
        for listener in list(self._status_listeners):
            listener(ready)
        self.report_load(force=True)

    def watch_status(self, listener) -> None:
        """listener(ready) now and whenever the shards' state changes (a router's stream)."""
        self._status_listeners.add(listener)
        listener(self.ready.is_set())

    def unwatch_status(self, listener) -> None:
        self._status_listeners.discard(listener)

    async def close(self) -> None:
        for stream in self._streams:
            stream.cancel()
        for ch in self._channels:
            await ch.close()

    # ---- requests ----

    def add(self, msg: scheduler_pb2.AddRequest, sink: RouterStream) -> None:
        if not self.ready.is_set():
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "shard workers are not ready")
        if self.scheduler.has_request(msg.request_id):
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {msg.request_id!r} is in flight")
        seq = Sequence(
            seq_id=self._next_seq_id,
            request_id=msg.request_id,
            token_ids=list(msg.prompt_token_ids),
            num_prompt_tokens=len(msg.prompt_token_ids),
            max_new_tokens=msg.max_new_tokens,
            stop_token_ids=frozenset(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            top_logprobs=msg.top_logprobs,
            sampling=msg.sampling,
            arrival_time=time.monotonic(),
        )
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self._next_seq_id += 1
        self._sinks[msg.request_id] = sink
        parent = tracing.context_from_carrier(msg.trace_context)
        if parent is not None:  # only requests the router traces get spans here
            span = self._tracer.start_span(
                "scheduler.request",
                context=parent,
                attributes={"tpserve.request_id": msg.request_id, "tpserve.seq_id": seq.seq_id},
            )
            queue = self._tracer.start_span("scheduler.queue", context=trace.set_span_in_context(span))
            self._traces[msg.request_id] = RequestTrace(span, queue)
        self._wakeup.set()
        self.grant_credit()

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now; the workers forget it with the next step."""
        if self.scheduler is not None and self.scheduler.abort(request_id) is not None:
            self._sinks.pop(request_id, None)
            self._end_trace(request_id, "aborted")
            self.grant_credit()

    def attach(self, router: RouterStream) -> None:
        """A router opened its stream: it learns the shards' state and its credit at once."""
        self._routers.add(router)
        self.watch_status(router.status)
        self.grant_credit()
        router.load(self.load_report(), force=True)

    def detach(self, router: RouterStream) -> None:
        """The router went away: drop everything it asked for."""
        self._routers.discard(router)
        self.unwatch_status(router.status)
        for request_id in [r for r, s in self._sinks.items() if s is router]:
            self.abort(request_id)

    def grant_credit(self) -> None:
        if self.scheduler is None:
            return
        window = self.scheduler.admission_window(self.config.admission_window)
        for router in self._routers:
            router.credit(window)

    def load_report(self) -> scheduler_pb2.LoadReport:
        """This replica's load, for the routers' choice among replicas (router/replicas.py)."""
        s = self.scheduler
        report = scheduler_pb2.LoadReport(
            max_num_seqs=self.config.policy.max_num_seqs, shards_ready=self.ready.is_set()
        )
        if s is not None:
            busy = bool(s.running or s.waiting)
            report.waiting = len(s.waiting) + len(s.swapped)
            report.running = len(s.running)
            report.kv_blocks_total = s.blocks.num_blocks
            report.kv_blocks_free = s.blocks.num_free_blocks
            if busy and self._recent_steps:
                report.step_seconds = sum(self._recent_steps) / len(self._recent_steps)
        return report

    def report_load(self, force: bool = False) -> None:
        if not self._routers:
            return
        report = self.load_report()
        for router in self._routers:
            copy = scheduler_pb2.LoadReport()
            copy.CopyFrom(report)  # each stream stamps its own adds_received
            router.load(copy, force)

    async def heartbeat(self, interval_s: float = 0.5) -> None:
        """Reports the load every interval_s whatever happens, from its own task: the step loop awaits
        the ranks, so a long step does not hold it back and the router does not take it for dead."""
        while True:
            await asyncio.sleep(interval_s)
            self.report_load(force=True)

    # ---- the loop ----

    async def serve_forever(self) -> None:
        """Connects to the ranks and runs the step loop. When a rank is lost, every request keeps its
        tokens here; once the ranks are back they are recomputed and go on. Requests still waiting
        after worker_recovery_timeout_s get UNAVAILABLE: none is dropped silently."""
        # A stream that already ended raises InvalidStateError on write (a rank died while idle).
        lost = (grpc.RpcError, TimeoutError, asyncio.InvalidStateError)
        while True:
            try:
                await self.connect_workers()
            except lost as e:
                log.warning("shard workers not reachable (%s); retrying", e)
                await self.close()
                await asyncio.sleep(1.0)
                continue
            try:
                await self._loop()
            except lost as e:
                await self._workers_lost(e)
                # A rank that fails the same step again and again (a poisonous request) must not spin:
                # back off, and keep the expiry running until a step succeeds after the reconnect.
                await asyncio.sleep(1.0)

    async def _loop(self) -> None:
        while True:
            self._wakeup.clear()  # cleared before scheduling, so an add during the step is not missed
            now = time.monotonic()
            # min_batch_size: a small batch with more requests on their way waits (boundedly) for them.
            wait_until = self.scheduler.batch_wait_deadline(now, self.incoming())
            out = None
            if wait_until is None:
                out = self.scheduler.schedule(now)
                self._pending_forget.extend(out.forgotten_seq_ids)
                self._note_admissions(out, now)
                wait_until = out.wake_at
            if out is None or out.is_empty:
                timeout = None if wait_until is None else max(0.0, wait_until - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                continue
            out.forgotten_seq_ids, self._pending_forget = self._pending_forget, []
            await self._step(out)
            if self._expiry is not None:  # the ranks are back and a step went through: recovered
                self._expiry.cancel()
                self._expiry = None

    def _note_admissions(self, out: SchedulerOutput, now: float) -> None:
        for seq in out.admitted:
            if seq.num_preemptions == 0:
                self.metrics.queue_time.observe(now - seq.arrival_time)
            rt = self._traces.get(seq.request_id)
            if rt is not None:
                if rt.queue_span is not None:
                    rt.queue_span.end()
                    rt.queue_span = None
                rt.span.add_event("admitted", {"tpserve.num_preemptions": seq.num_preemptions})
        for seq in out.swapped_in:
            rt = self._traces.get(seq.request_id)
            if rt is not None:
                rt.span.add_event("swapped in", {"tpserve.num_computed_tokens": seq.num_computed_tokens})
        swapped = {seq.seq_id for seq in out.swapped_out}
        for seq in out.preempted:
            kind = "swap" if seq.seq_id in swapped else "recompute"
            self.metrics.preemptions.labels(kind=kind).inc()
            rt = self._traces.get(seq.request_id)
            if rt is not None:
                rt.span.add_event("preempted", {"tpserve.kind": kind})

    def _step_span(self, out: SchedulerOutput):
        """A span for this step when a traced request rides it: a child of the oldest traced request,
        linked from the others (one step serves many traces)."""
        traced = [rt.span for s in out.scheduled if (rt := self._traces.get(s.seq.request_id)) is not None]
        if not traced:
            return None
        links = [trace.Link(span.get_span_context()) for span in traced[1:]]
        return self._tracer.start_span(
            "scheduler.step",
            context=trace.set_span_in_context(traced[0]),
            links=links,
            attributes={
                "tpserve.batch_size": len(out.scheduled),
                "tpserve.batch_tokens": out.num_batched_tokens,
            },
        )

    async def _step(self, out: SchedulerOutput) -> None:
        start = time.perf_counter()
        request = step_request(self._builder.build(out))
        span = self._step_span(out)
        if span is not None:
            request.trace_context.update(tracing.carrier(span))
        try:
            for stream in self._streams:
                await stream.write(request)
            timeout = self.config.step_timeout_s
            responses = [await asyncio.wait_for(stream.read(), timeout) for stream in self._streams]
        finally:
            if span is not None:
                span.end()
        for r in responses:
            if r is grpc.aio.EOF or r.step_id != request.step_id:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "worker stream ended")
        first = responses[0]
        updates = self.scheduler.update(out, list(first.token_ids))
        self._dispatch(out, updates, first)
        if self.fallback is not None:
            self._observe_fallback(len(first.token_ids))
        self.grant_credit()
        step_seconds = time.perf_counter() - start
        self._recent_steps.append(step_seconds)
        self.report_load()
        forward = max(r.forward_seconds for r in responses)
        allreduce = max(r.allreduce_seconds for r in responses)
        t = self.totals
        t.steps += 1
        t.batched_seqs += len(out.scheduled)
        t.batched_tokens += out.num_batched_tokens
        t.step_seconds += step_seconds
        t.forward_seconds += forward
        t.allreduce_seconds += allreduce
        m = self.metrics
        m.step_duration.observe(step_seconds)
        m.forward_duration.observe(forward)
        m.allreduce_duration.observe(allreduce)
        m.batch_size.observe(len(out.scheduled))
        m.batch_tokens.observe(out.num_batched_tokens)

    def wake(self) -> None:
        """Something changed that the loop should look at (a router's queue depth)."""
        self._wakeup.set()

    def incoming(self) -> int:
        """Requests on their way: held by the routers for lack of credit."""
        return sum(r.queued for r in self._routers)

    def _observe_fallback(self, output_tokens: int) -> None:
        s = self.scheduler
        # Every request in the system counts: on its way, waiting, swapped out or running.
        load = min(self.incoming() + len(s.waiting) + len(s.swapped) + len(s.running), s.policy.max_num_seqs)
        switch = self.fallback.observe(time.monotonic(), output_tokens, load)
        if switch is not None:
            log.warning("static fallback: %s", switch)
            self.metrics.fallback_switches.labels(to=switch.to_mode, reason=switch.reason).inc()
            s.set_batching(switch.to_mode)

    def _end_trace(self, request_id: str, reason: str) -> None:
        rt = self._traces.pop(request_id, None)
        if rt is not None:
            if rt.queue_span is not None:
                rt.queue_span.end()
            rt.span.add_event("finished", {"tpserve.finish_reason": reason})
            rt.span.end()

    def _dispatch(self, out: SchedulerOutput, updates: list[SequenceUpdate], resp) -> None:
        # Logprobs arrive flat over every sampled sequence; walk them in the same order.
        want_logprobs = len(resp.logprobs) > 0
        logprob_of = {}
        if want_logprobs:
            top_at = 0
            for i, item in enumerate(s for s in out.scheduled if s.do_sample):
                n = item.seq.top_logprobs
                if n:
                    top = [
                        generation_pb2.TokenLogprob(token_id=tid, logprob=lp)
                        for tid, lp in zip(
                            resp.top_token_ids[top_at : top_at + n],
                            resp.top_logprobs[top_at : top_at + n],
                            strict=True,
                        )
                    ]
                    chosen = generation_pb2.TokenLogprob(token_id=resp.token_ids[i], logprob=resp.logprobs[i])
                    logprob_of[item.seq.seq_id] = generation_pb2.Logprobs(chosen=chosen, top=top)
                top_at += n
        batches: dict[int, tuple[RouterStream, list]] = {}
        for u in updates:
            seq = u.seq
            sink = self._sinks.get(seq.request_id)
            if sink is None:
                continue
            output = scheduler_pb2.RequestOutput(request_id=seq.request_id, token_ids=[u.new_token])
            if seq.seq_id in logprob_of:
                output.logprobs.append(logprob_of[seq.seq_id])
            if u.finished:
                output.finish_reason = int(seq.finish_reason)
                output.cached_tokens = seq.num_cached_tokens
                del self._sinks[seq.request_id]
                self._end_trace(seq.request_id, seq.finish_reason.name.lower())
            batches.setdefault(id(sink), (sink, []))[1].append(output)
        for sink, outputs in batches.values():
            sink.outputs(outputs)

    async def _workers_lost(self, error: Exception) -> None:
        """A rank failed or went silent. Its peers' caches are useless too (the group must re-form), so
        every running sequence is requeued for recompute while the ranks are restarted."""
        detail = error.details() if isinstance(error, grpc.RpcError) else "step timed out"
        log.error("lost a shard worker (%s): waiting for the ranks to return", detail)
        self._set_ready(False)
        await self.close()
        self.scheduler.requeue_all()
        self._pending_forget = []
        if self.fallback is not None:
            self.fallback.interrupt()  # recompute after a loss is not a throughput regression
        # The first loss starts the clock; failures before the next good step do not reset it.
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.create_task(self._expire_after(self.config.worker_recovery_timeout_s))

    async def _expire_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        log.error("shard workers still lost after %.0fs: failing %d request(s)", seconds, len(self._sinks))
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            self.scheduler.abort(request_id)
            self._end_trace(request_id, "unavailable")
            sink.outputs(
                [
                    scheduler_pb2.RequestOutput(
                        request_id=request_id,
                        error="a shard worker was lost and did not return in time",
                        error_code="UNAVAILABLE",
                    )
                ]
            )

    # ---- introspection ----

    def stats(self) -> generation_pb2.Stats:
        s = self.scheduler
        if s is None:
            return generation_pb2.Stats()
        return generation_pb2.Stats(
            kv_blocks_total=s.blocks.num_blocks,
            kv_blocks_free=s.blocks.num_free_blocks,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_swapped=len(s.swapped),
            num_preemptions_total=s.num_preemptions,
            num_steps_total=self.totals.steps,
            batched_seqs_total=self.totals.batched_seqs,
            batched_tokens_total=self.totals.batched_tokens,
            step_seconds_total=self.totals.step_seconds,
            forward_seconds_total=self.totals.forward_seconds,
            allreduce_seconds_total=self.totals.allreduce_seconds,
        )
