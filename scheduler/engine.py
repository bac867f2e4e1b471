"""The scheduler's step loop: schedule an iteration, run it on every rank, apply the sampled tokens,
publish what the step did.

    while True:
        out = await self._next_batch()        # Scheduler.schedule(), waiting while there is nothing to do
        replies = await self._execute(out)    # one StepRequest to every rank (scheduler/workers.py)
        updates = self.scheduler.update(out, replies[0].token_ids)
        self._publish(StepResult(...))        # routers, traces, metrics, the static fallback, totals

Everything the step loop touches runs on one asyncio loop, so there are no locks. The jobs around it
have their own modules: the ranks (workers.py), the capacity they agree on (capacity.py), the routers'
streams with credit and load (router_streams.py), the traces (spans.py), the metrics (metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

from common import tracing
from common.pb.tpserve.internal.v1 import scheduler_pb2, worker_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import (
    ERROR_CODE_ALREADY_EXISTS,
    ERROR_CODE_INVALID_ARGUMENT,
    ERROR_CODE_UNAVAILABLE,
)
from common.pb.tpserve.v1 import generation_pb2
from scheduler.batch import StepBuilder, StepPlan
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.fallback import FallbackPolicy, ThroughputFallback
from scheduler.metrics import SchedulerMetrics
from scheduler.router_streams import LOAD_REPORT_INTERVAL_S, RouterStream, RouterStreams
from scheduler.scheduler import Scheduler, SchedulerOutput, SchedulerSnapshot, SequenceUpdate
from scheduler.sequence import FinishReason, Sequence
from scheduler.spans import RequestSpans
from scheduler.swap import HostBlockPool
from scheduler.workers import WorkerGroup, WorkersLost

log = logging.getLogger("tpserve.scheduler")


class RequestError(Exception):
    """A request this scheduler refuses; travels back to the router as its RequestOutput's error."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code  # a scheduler_pb2.ErrorCode


@dataclass
class StepTotals:
    """Running sums the benchmark and GetStats read (mean batch size, time per step)."""

    steps: int = 0
    batched_seqs: int = 0
    batched_tokens: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    allreduce_seconds: float = 0.0


@dataclass(frozen=True)
class StepResult:
    """What one iteration did: everything that reports on steps reads this."""

    out: SchedulerOutput
    updates: list[SequenceUpdate]
    replies: list[worker_pb2.StepResponse]  # in rank order; rank 0's carries the samples
    seconds: float  # wall time of the whole step: plan, send, forward, receive, apply

    @property
    def forward_seconds(self) -> float:
        return max(r.forward_seconds for r in self.replies)

    @property
    def allreduce_seconds(self) -> float:
        return max(r.allreduce_seconds for r in self.replies)


def step_request(plan: StepPlan) -> worker_pb2.StepRequest:
    pack = StepPlan.pack
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
        forgotten_seq_ids=plan.forgotten_seq_ids,
        seq_ids=pack(plan.seq_ids),
        query_lens=pack(plan.query_lens),
        context_lens=pack(plan.context_lens),
        do_sample=pack(plan.do_sample),
        input_ids=pack(plan.input_ids),
        positions=pack(plan.positions),
        slot_mapping=pack(plan.slot_mapping),
        table_reset=pack(plan.table_reset),
        new_block_counts=pack(plan.new_block_counts),
        new_block_ids=pack(plan.new_block_ids),
        swap_out_src=plan.swap_out_src,
        swap_out_dst=plan.swap_out_dst,
        swap_in_src=plan.swap_in_src,
        swap_in_dst=plan.swap_in_dst,
    )


class Engine:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.ready = asyncio.Event()  # every rank connected with its cache allocated
        self.scheduler: Scheduler | None = None  # built once the ranks said what they hold
        self.model_info: generation_pb2.ModelInfo | None = None
        self.workers = WorkerGroup(config)
        self.routers = RouterStreams()
        self.spans = RequestSpans()
        self.totals = StepTotals()
        self.metrics = SchedulerMetrics(self)
        self.fallback = ThroughputFallback(FallbackPolicy()) if config.fallback_static else None
        self._builder = StepBuilder(config.block_size)
        self._recent_steps: deque[float] = deque(maxlen=8)  # seconds per step, for the load reports
        self._wakeup = asyncio.Event()
        self._next_seq_id = 0
        self._forgotten: list[int] = []  # sequences the workers may forget, not told yet
        self._status_listeners: set = set()
        self._expiry: asyncio.Task | None = None

    # ---- the loop ----

    async def serve_forever(self) -> None:
        """Connects to the ranks and runs the step loop. When a rank is lost, every request keeps its
        tokens here; once the ranks are back they are recomputed and go on. Requests still waiting
        after worker_recovery_timeout_s get UNAVAILABLE: none is dropped silently."""
        while True:
            try:
                await self._connect()
            except WorkersLost as e:
                log.warning("shard workers not reachable (%s); retrying", e)
                await asyncio.sleep(1.0)
                continue
            try:
                await self._run()
            except WorkersLost as e:
                await self._workers_lost(e)
                # A rank that fails the same step again and again (a poisonous request) must not spin:
                # back off, and keep the expiry running until a step succeeds after the reconnect.
                await asyncio.sleep(1.0)

    async def _run(self) -> None:
        while True:
            out = await self._next_batch()
            start = time.perf_counter()
            replies = await self._execute(out)
            updates = self.scheduler.update(out, list(replies[0].token_ids))
            self._publish(StepResult(out, updates, replies, time.perf_counter() - start))

    async def _next_batch(self) -> SchedulerOutput:
        """The next step with work in it, waiting while there is none (or while min_batch_size waits
        for requests on their way)."""
        while True:
            self._wakeup.clear()  # cleared before scheduling, so an add during the step is not missed
            now = time.monotonic()
            wait_until = self.scheduler.batch_wait_deadline(
                now, self.routers.queued(), self.config.admission_window
            )
            out = None
            if wait_until is None:
                out = self.scheduler.schedule(now)
                self._forgotten.extend(out.forgotten_seq_ids)
                self._scheduled(out, now)
                wait_until = out.wake_at
            if out is not None and not out.is_empty:
                out.forgotten_seq_ids, self._forgotten = self._forgotten, []
                return out
            timeout = None if wait_until is None else max(0.0, wait_until - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)

    def _scheduled(self, out: SchedulerOutput, now: float) -> None:
        for seq in out.admitted:
            if seq.num_preemptions == 0:
                self.metrics.queue_time.observe(now - seq.arrival_time)
        swapped = {seq.seq_id for seq in out.swapped_out}
        for seq in out.preempted:
            self.metrics.preemptions.labels(kind="swap" if seq.seq_id in swapped else "recompute").inc()
        self.spans.scheduled(out)

    async def _execute(self, out: SchedulerOutput) -> list[worker_pb2.StepResponse]:
        plan = self._builder.build(out)
        request = step_request(plan)
        span = self.spans.step_span(out)
        try:
            if span is not None:
                request.trace_context.update(tracing.carrier(span))
            # Serialized once for every rank.
            return await self.workers.step(request.SerializeToString(), plan.step_id)
        finally:
            if span is not None:
                span.end()

    def _publish(self, result: StepResult) -> None:
        outputs, finished = self._outputs(result)
        if self.fallback is not None:
            self._observe_fallback(len(result.replies[0].token_ids))
        self._recent_steps.append(result.seconds)
        self._count(result)
        self._report(outputs)
        for request_id in finished:
            self.routers.release(request_id)
        if self._expiry is not None:  # the ranks are back and a step went through: recovered
            self._expiry.cancel()
            self._expiry = None

    def _outputs(self, result: StepResult) -> tuple[list[scheduler_pb2.RequestOutput], list[str]]:
        """A RequestOutput per sequence that got a token; the requests that finished."""
        logprobs = _logprobs(result.out, result.replies[0])
        outputs, finished = [], []
        for u in result.updates:
            seq = u.seq
            output = scheduler_pb2.RequestOutput(request_id=seq.request_id, token_ids=[u.new_token])
            if seq.seq_id in logprobs:
                output.logprobs.append(logprobs[seq.seq_id])
            if u.finished:
                output.finish_reason = seq.finish_reason
                output.cached_tokens = seq.num_cached_tokens
                finished.append(seq.request_id)
                self.spans.end(seq.request_id, FinishReason.Name(seq.finish_reason).lower())
            outputs.append(output)
        return outputs, finished

    def _count(self, result: StepResult) -> None:
        out, t, m = result.out, self.totals, self.metrics
        forward, allreduce = result.forward_seconds, result.allreduce_seconds
        t.steps += 1
        t.batched_seqs += len(out.scheduled)
        t.batched_tokens += out.num_batched_tokens
        t.step_seconds += result.seconds
        t.forward_seconds += forward
        t.allreduce_seconds += allreduce
        m.step_duration.observe(result.seconds)
        m.forward_duration.observe(forward)
        m.allreduce_duration.observe(allreduce)
        m.batch_size.observe(len(out.scheduled))
        m.batch_tokens.observe(out.num_batched_tokens)

    def _observe_fallback(self, output_tokens: int) -> None:
        # Every request in the system counts: queued in the router, waiting, swapped out or running.
        snap = self.scheduler.snapshot()
        load = min(self.routers.queued() + snap.in_flight, self.scheduler.policy.max_num_seqs)
        switch = self.fallback.observe(time.monotonic(), output_tokens, load)
        if switch is not None:
            log.warning("static fallback: %s", switch)
            self.metrics.fallback_switches.labels(to=switch.to_mode, reason=switch.reason).inc()
            self.scheduler.set_batching(switch.to_mode)

    # ---- the ranks ----

    async def _connect(self) -> None:
        info = await self.workers.connect()
        cfg, cap, first = self.config, info.capacity, info.describe[0]
        blocks = BlockManager(cap.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        host_blocks = HostBlockPool(cap.num_host_blocks) if cap.num_host_blocks else None
        if cfg.swap_space:
            log.info("swap space: %d host blocks per rank (%.2f GiB)", cap.num_host_blocks, cfg.swap_space)
        if self.scheduler is None:
            policy = cfg.resolved_policy(cap.max_model_len)
            self.scheduler = Scheduler(policy, blocks, first.eos_token_ids, host_blocks)
        else:  # the ranks came back: same requests, fresh caches (and maybe another capacity)
            too_long = self.scheduler.replace_blocks(blocks, host_blocks, cap.max_model_len)
            self._fail(
                [s.request_id for s in too_long],
                ERROR_CODE_UNAVAILABLE,
                f"the replica's ranks came back holding at most {cap.max_model_len} tokens per sequence, "
                "fewer than the request needs",
            )
        self.model_info = generation_pb2.ModelInfo(
            model_name=first.model_name,
            vocab_size=first.vocab_size,
            max_model_len=cap.max_model_len,
            eos_token_ids=first.eos_token_ids,
            tensor_parallel_size=len(info.describe),
            block_size=cfg.block_size,
        )
        self._builder.forget_all()
        log.info(
            "model %s on %d rank(s) (%s), max_model_len %d",
            first.model_name,
            len(info.describe),
            ", ".join(i.device for i in info.describe),
            cap.max_model_len,
        )
        self._set_ready(True)

    async def _workers_lost(self, error: WorkersLost) -> None:
        """A rank failed or went silent. Its peers' caches are useless too (the group must re-form), so
        every running sequence is requeued for recompute while the ranks are restarted."""
        log.error("lost a shard worker (%s): waiting for the ranks to return", error)
        self._set_ready(False)
        await self.workers.close()
        self.scheduler.requeue_all()
        self._forgotten = []
        if self.fallback is not None:
            self.fallback.interrupt()  # recompute after a loss is not a throughput regression
        # The first loss starts the clock; failures before the next good step do not reset it.
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.create_task(self._expire_after(self.config.worker_recovery_timeout_s))

    async def _expire_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        request_ids = self.routers.request_ids
        log.error("shard workers still lost after %.0fs: failing %d request(s)", seconds, len(request_ids))
        self._fail(request_ids, ERROR_CODE_UNAVAILABLE, "a shard worker was lost and did not return in time")

    def _fail(self, request_ids: list[str], code: int, message: str) -> None:
        """Ends these requests with an error their routers pass on (UNAVAILABLE: they may go elsewhere)."""
        if not request_ids:
            return
        outputs = []
        for request_id in request_ids:
            self.scheduler.abort(request_id)
            self.spans.end(request_id, "failed")
            outputs.append(scheduler_pb2.RequestOutput(request_id=request_id, error=message, error_code=code))
        self._report(outputs)
        for request_id in request_ids:
            self.routers.release(request_id)

    def _set_ready(self, ready: bool) -> None:
        if ready:
            self.ready.set()
        else:
            self.ready.clear()
        for listener in list(self._status_listeners):
            listener(ready)
        self.routers.shards_ready(ready, self.model_info)
        self._report(force_load=True)

    def watch_status(self, listener) -> None:
        """listener(ready) now and whenever the shards' state changes (the health service)."""
        self._status_listeners.add(listener)
        listener(self.ready.is_set())

    async def close(self) -> None:
        await self.workers.close()

    # ---- the routers ----

    def attach(self, stream: RouterStream) -> None:
        """A router opened its stream: it learns the shards' state, its credit and the load at once."""
        self.routers.attach(stream)
        self.routers.shards_ready(self.ready.is_set(), self.model_info, stream)
        self._report(force_load=True)

    def detach(self, stream: RouterStream) -> None:
        """The router went away: drop everything it asked for."""
        for request_id in self.routers.detach(stream):
            self.abort(request_id)

    def add(self, msg: scheduler_pb2.AddRequest, stream: RouterStream) -> None:
        """Takes a request in; a refusal goes back on the stream as the request's error."""
        stream.adds_received += 1
        try:
            seq = self._sequence(msg)
            self.scheduler.add(seq)
        except RequestError as e:
            self._refuse(stream, msg.request_id, e.code, str(e))
            return
        except ValueError as e:  # longer than this replica's max_model_len
            self._refuse(stream, msg.request_id, ERROR_CODE_INVALID_ARGUMENT, str(e))
            return
        self._next_seq_id += 1
        self.routers.bind(msg.request_id, stream)
        self.spans.start(seq, msg.trace_context)
        self._wakeup.set()

    def _refuse(self, stream: RouterStream, request_id: str, code: int, message: str) -> None:
        """The error, and the credit the refused add used given back, in one message."""
        error = scheduler_pb2.RequestOutput(request_id=request_id, error=message, error_code=code)
        window = (
            None if self.scheduler is None else self.scheduler.admission_window(self.config.admission_window)
        )
        stream.send(stream.message([error], window, self.load_report()))

    def _sequence(self, msg: scheduler_pb2.AddRequest) -> Sequence:
        # Shards lost after they were ready do not refuse a request that was already on its way: it waits
        # with the others for them to return (or for worker_recovery_timeout_s, then UNAVAILABLE).
        if self.scheduler is None:
            raise RequestError(ERROR_CODE_UNAVAILABLE, "shard workers are not ready")
        if self.scheduler.has_request(msg.request_id):
            raise RequestError(ERROR_CODE_ALREADY_EXISTS, f"request_id {msg.request_id!r} is in flight")
        if msg.num_output_tokens >= len(msg.prompt_token_ids):
            raise RequestError(
                ERROR_CODE_INVALID_ARGUMENT,
                f"num_output_tokens {msg.num_output_tokens} leaves no prompt in "
                f"{len(msg.prompt_token_ids)} tokens",
            )
        return Sequence(
            seq_id=self._next_seq_id,
            request_id=msg.request_id,
            token_ids=list(msg.prompt_token_ids),
            # A resumed request's own outputs are outputs here too (max_new_tokens, seeded draws).
            num_prompt_tokens=len(msg.prompt_token_ids) - msg.num_output_tokens,
            max_new_tokens=msg.max_new_tokens,
            stop_token_ids=frozenset(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            top_logprobs=msg.top_logprobs,
            sampling=msg.sampling,
            arrival_time=time.monotonic(),
        )

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now; the workers forget it with the next step."""
        if self.scheduler is not None and self.scheduler.abort(request_id) is not None:
            self.routers.release(request_id)
            self.spans.end(request_id, "aborted")
            self._report()

    def queued_changed(self) -> None:
        """A router's queue changed size: min_batch_size may stop waiting."""
        self._wakeup.set()

    def _report(self, outputs=(), force_load: bool = False) -> None:
        """Sends each router its outputs, with the credit and the load when they changed."""
        window = load = None
        if self.scheduler is not None:
            window = self.scheduler.admission_window(self.config.admission_window)
            load = self.load_report()
        elif force_load:
            load = self.load_report()
        self.routers.publish(outputs, window, load, force_load)

    async def heartbeat(self) -> None:
        """Reports the load every LOAD_REPORT_INTERVAL_S whatever happens, from its own task: the step
        loop awaits the ranks, so a long step does not hold it back and the router does not take the
        replica for dead."""
        while True:
            await asyncio.sleep(LOAD_REPORT_INTERVAL_S)
            self._report(force_load=True)

    # ---- what the replica reports ----

    def snapshot(self) -> SchedulerSnapshot | None:
        return None if self.scheduler is None else self.scheduler.snapshot()

    def load_report(self) -> scheduler_pb2.LoadReport:
        """This replica's load, for the routers' choice among replicas (router/replicas.py)."""
        report = scheduler_pb2.LoadReport(
            max_num_seqs=self.config.policy.max_num_seqs, shards_ready=self.ready.is_set()
        )
        snap = self.snapshot()
        if snap is not None:
            report.waiting, report.swapped, report.running = snap.waiting, snap.swapped, snap.running
            report.kv_blocks_total, report.kv_blocks_free = snap.kv_blocks_total, snap.kv_blocks_free
            if snap.in_flight and self._recent_steps:
                report.step_seconds = sum(self._recent_steps) / len(self._recent_steps)
        return report

    def stats(self) -> generation_pb2.Stats:
        snap = self.snapshot()
        if snap is None:
            return generation_pb2.Stats()
        t = self.totals
        return generation_pb2.Stats(
            kv_blocks_total=snap.kv_blocks_total,
            kv_blocks_free=snap.kv_blocks_free,
            num_running=snap.running,
            num_waiting=snap.waiting,
            num_swapped=snap.swapped,
            num_preemptions_total=snap.num_preemptions,
            num_steps_total=t.steps,
            batched_seqs_total=t.batched_seqs,
            batched_tokens_total=t.batched_tokens,
            step_seconds_total=t.step_seconds,
            forward_seconds_total=t.forward_seconds,
            allreduce_seconds_total=t.allreduce_seconds,
        )


def _logprobs(out: SchedulerOutput, reply: worker_pb2.StepResponse) -> dict[int, generation_pb2.Logprobs]:
    """Per sampled sequence that asked, its logprobs. They arrive flat over every sampled sequence, in
    batch order, each with top_logprobs alternatives."""
    if not len(reply.logprobs):
        return {}
    found, top_at = {}, 0
    for i, item in enumerate(s for s in out.scheduled if s.do_sample):
        n = item.seq.top_logprobs
        if n:
            top = [
                generation_pb2.TokenLogprob(token_id=tid, logprob=lp)
                for tid, lp in zip(
                    reply.top_token_ids[top_at : top_at + n],
                    reply.top_logprobs[top_at : top_at + n],
                    strict=True,
                )
            ]
            chosen = generation_pb2.TokenLogprob(token_id=reply.token_ids[i], logprob=reply.logprobs[i])
            found[item.seq.seq_id] = generation_pb2.Logprobs(chosen=chosen, top=top)
        top_at += n
    return found
