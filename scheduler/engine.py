"""The scheduler's step loop: schedule an iteration, run it on every rank, apply the sampled tokens,
publish what the step did.

    while True:
        out = await self._next_batch()        # Scheduler.schedule(), waiting while there is nothing to do
        replies = await self._execute(out)    # one StepRequest to every rank (scheduler/workers.py)
        updates = self.scheduler.update(out, self._sampled(out, replies))  # checked whole (replies.py)
        self._publish(StepResult(...))        # routers, traces, metrics, the static fallback, totals

With --async-scheduling, overlap.py's loop runs instead: the next step is sent before this one returns.
Every request ends through `_end`, whatever the reason: its last output goes to its router, then its
span ends and its router's credit comes back. Everything runs on one asyncio loop: no locks. The ranks
sit behind a small interface (workers.py's WorkerGroup), so a fake group drives the engine in unit tests.
Around the loop: connecting the ranks, their loss and recovery (ranks.py, with the capacity they agree
on, capacity.py); what the routers call and every report they get (router_side.py, over their streams
with credit, load and KV events, router_streams.py); traces (spans.py), metrics (metrics.py), reports
(reports.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from common import tracing
from common.pb.tpserve.internal.v1 import scheduler_pb2, worker_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_INVALID_ARGUMENT, ERROR_CODE_NOT_FOUND
from common.pb.tpserve.v1 import generation_pb2
from scheduler.batch import StepBuilder
from scheduler.config import SchedulerConfig
from scheduler.fallback import FallbackPolicy, ThroughputFallback
from scheduler.lora_admin import LoRAAdmin
from scheduler.metrics import SchedulerMetrics
from scheduler.overlap import OverlapLoop
from scheduler.plan import SchedulerOutput
from scheduler.ranks import RankLifecycle
from scheduler.recovery import expire_while_lost
from scheduler.replies import check_replies
from scheduler.reports import StepResult, StepTotals, step_outputs
from scheduler.router_side import RouterSide
from scheduler.router_streams import RouterStreams
from scheduler.scheduler import Scheduler
from scheduler.sequence import FinishReason
from scheduler.spans import RequestSpans
from scheduler.speculation import Speculator
from scheduler.tasks import TaskEnded, first_to_end
from scheduler.workers import WorkerGroup

log = logging.getLogger("tpserve.scheduler")


class Engine(RankLifecycle, RouterSide):
    def __init__(self, config: SchedulerConfig, workers: WorkerGroup | None = None):
        self.config = config
        self.ready = asyncio.Event()  # every rank connected with its cache allocated
        self.scheduler: Scheduler | None = None  # built once the ranks said what they hold
        self.model_info: generation_pb2.ModelInfo | None = None
        self.workers = workers if workers is not None else WorkerGroup(config)
        self.routers = RouterStreams()
        self.spans = RequestSpans()
        self.totals = StepTotals()
        self.metrics = SchedulerMetrics(self)
        self.fallback = ThroughputFallback(FallbackPolicy()) if config.fallback_static else None
        # Speculative decoding's proposer, and its count of what the verifications accepted.
        self.speculator = Speculator(config.speculative) if config.speculative.enabled else None
        # The LoRA adapters served: loaded and unloaded while serving (scheduler/lora_admin.py).
        self.loras = LoRAAdmin(config.enable_lora, config.lora_modules, self.workers, self._on_adapter)
        self._builder = StepBuilder()
        self._recent_steps: deque[float] = deque(maxlen=8)  # seconds per step, for the load reports
        self._wakeup = asyncio.Event()
        self._next_seq_id = 0
        self._status_listeners: set = set()
        self._lost_at: float | None = None  # when the ranks were lost, until a step succeeds again
        # Wakes the expiry (ranks lost, or a request arrived while they are): its own event, since the
        # step loop's _wakeup stays set through a step and would make the expiry spin.
        self._expiry_wakeup = asyncio.Event()

    # ---- the loop ----

    async def serve_forever(self) -> None:
        """Connects to the ranks and runs the step loop. When a rank is lost, every request keeps its
        tokens here; once the ranks are back they are recomputed and go on. A request still waiting
        worker_recovery_timeout_s after the loss (or after its arrival, if later) gets UNAVAILABLE:
        none is dropped silently. Either task failing ends both, with its error (tasks.py)."""
        ended = await first_to_end({"step loop": self._steps(), "recovery expiry": expire_while_lost(self)})
        raise TaskEnded(f"the scheduler's {ended} task returned")

    async def _run(self) -> None:
        if self.config.async_scheduling:
            return await OverlapLoop(self).run()
        while True:
            out = await self._next_batch()
            start = time.perf_counter()
            replies = await self._execute(out)
            tokens = self._sampled(out, replies)
            updates = self.scheduler.update(out, tokens)
            self._grammars(replies[0])
            if self.speculator is not None:
                self.speculator.observe(out.sampled, tokens)
            self._publish(StepResult(out, updates, replies, time.perf_counter() - start))

    async def _next_batch(self) -> SchedulerOutput:
        """The next step with work in it, waiting while there is none (or while min_batch_size waits for
        requests on their way). A rank lost meanwhile ends the wait with WorkersLost."""
        while True:
            self._wakeup.clear()  # cleared before scheduling, so an add during the step is not missed
            self.workers.check()
            now = time.monotonic()
            wait_until = self.scheduler.batch_wait_deadline(now, self.routers.queued(), self.admission_depth)
            out = None
            if wait_until is None:
                out = self.scheduler.schedule(now)
                self._scheduled(out, now)
                wait_until = out.wake_at
            if out is not None and not out.is_empty:
                return out
            timeout = None if wait_until is None else max(0.0, wait_until - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)

    def _scheduled(self, out: SchedulerOutput, now: float) -> None:
        for seq in out.first_admitted:
            self.metrics.queue_time.observe(now - seq.arrival_time)
        swapped = {seq.seq_id for seq in out.swapped_out}
        for seq in out.preempted:
            self.metrics.preemptions.labels(kind="swap" if seq.seq_id in swapped else "recompute").inc()
        self.spans.scheduled(out)

    async def _execute(self, out: SchedulerOutput) -> list[worker_pb2.StepResponse]:
        request = self._builder.build(out)
        span = self.spans.step_span(out)
        try:
            if span is not None:
                request.trace_context.update(tracing.carrier(span))
            # Serialized once for every rank.
            return await self.workers.step(request.SerializeToString(), request.step_id)
        finally:
            if span is not None:
                span.end()

    def _publish(self, result: StepResult) -> None:
        outputs = step_outputs(result)
        if self.fallback is not None:
            self._observe_fallback(len(result.replies[0].token_ids))
        self._recent_steps.append(result.seconds)
        self.scheduler.step_s = result.seconds
        self.totals.add(result, self.metrics)
        name = FinishReason.Name
        ended = [(u.seq.request_id, name(u.seq.finish_reason).lower()) for u in result.updates if u.finished]
        self._end(ended, outputs)
        self._lost_at = None  # a step went through: the ranks are back

    def _end(self, ended: list[tuple[str, str]], outputs=()) -> None:
        """The one way requests end (finished, aborted, failed, expired): the outputs go to their routers
        first (the routing needs the owner), then each ended request's span ends and its router's credit
        comes back. (request id, reason) per ended request; the scheduler has already let go of them."""
        self._report(outputs)
        for request_id, reason in ended:
            self.spans.end(request_id, reason)
            self.routers.release(request_id)
        if ended and self.loras.draining:
            self.loras.tidy()

    def _on_adapter(self, lora_name: str) -> int:
        """The requests in flight on a LoRA adapter."""
        seqs = () if self.scheduler is None else self.scheduler.sequences()
        return sum(1 for s in seqs if s.lora_name == lora_name)

    def _fail(self, request_ids: list[str], code: int, message: str, reason: str = "failed") -> None:
        """Ends these requests with an error their routers pass on (UNAVAILABLE: they may go elsewhere)."""
        if not request_ids:
            return
        for request_id in request_ids:
            self.scheduler.abort(request_id)
        outputs = [
            scheduler_pb2.RequestOutput(request_id=r, error=message, error_code=code) for r in request_ids
        ]
        self._end([(r, reason) for r in request_ids], outputs)

    def _sampled(self, out: SchedulerOutput, replies: list[worker_pb2.StepResponse]) -> list[list[int]]:
        """Rank 0's tokens per sampled sequence, every reply checked first (replies.py): a malformed
        one is a lost rank (MalformedReply), found before any sequence changes. Requests on an adapter
        a rank could not read end first (NOT_FOUND naming it): their tokens, of the base model, drop."""
        tokens = check_replies(out, replies, self.model_info.vocab_size, self._next_seq_id)
        for e in {e.lora_name: e for r in replies for e in r.lora_errors}.values():
            self._adapter_fetched(e.lora_name, e.message, held_only=False)
        return tokens

    def _adapter_fetched(self, name: str, error: str | None, held_only: bool = True) -> None:
        """The ranks read an adapter (LoRAAdmin.prefetch): the requests held for it may be admitted; or
        its files do not read, and they (with held_only False, every request on it) fail, NOT_FOUND."""
        seqs = [s for s in self.scheduler.sequences() if s.lora_name == name]
        held = [s for s in seqs if not s.adapter_ready]
        if error is not None:
            self._fail([s.request_id for s in (held if held_only else seqs)], ERROR_CODE_NOT_FOUND, error)
            return
        for seq in held:
            seq.adapter_ready = True
        self._wakeup.set()

    def _grammars(self, reply: worker_pb2.StepResponse) -> None:
        """Rank 0's news of the grammars it compiles: ready ones may be admitted, failed ones end."""
        self.scheduler.grammars_ready(reply.grammar_ready_seq_ids)
        if reply.grammar_errors:
            by_id = {s.seq_id: s.request_id for s in self.scheduler.sequences()}
            for e in reply.grammar_errors:
                if e.seq_id in by_id:
                    message = f"sampling.structured_output does not compile: {e.message}"
                    self._fail([by_id[e.seq_id]], ERROR_CODE_INVALID_ARGUMENT, message)

    def _observe_fallback(self, output_tokens: int) -> None:
        # Every request in the system counts: queued in the router, waiting, swapped out or running.
        snap = self.scheduler.snapshot()
        load = min(self.routers.queued() + snap.in_flight, self.scheduler.policy.max_num_seqs)
        switch = self.fallback.observe(time.monotonic(), output_tokens, load)
        if switch is not None:
            log.warning("static fallback: %s", switch)
            self.metrics.fallback_switches.labels(to=switch.to_mode, reason=switch.reason).inc()
            self.scheduler.set_batching(switch.to_mode)
