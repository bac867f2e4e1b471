"""The scheduler's part of a request's trace: a span for its whole stay, a queue span until its first
step, events for what happened to it (admitted, preempted, swapped in, finished), and one span per step
that a traced request rides.

Only requests the router traces (their AddRequest carries a trace context) get spans. Without an SDK
provider (no exporter configured) every span is the API's non-recording one: a step costs a dict lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from common import tracing
from scheduler.plan import SchedulerOutput
from scheduler.sequence import Sequence


@dataclass
class _RequestSpans:
    span: object  # the request's stay in the scheduler
    queue: object | None  # until its first step


class RequestSpans:
    def __init__(self):
        self._tracer = tracing.tracer("tpserve.scheduler")
        self._requests: dict[str, _RequestSpans] = {}

    def start(self, seq: Sequence, trace_context) -> None:
        parent = tracing.context_from_carrier(trace_context)
        if parent is None:
            return
        span = self._tracer.start_span(
            "scheduler.request",
            context=parent,
            attributes={"tpserve.request_id": seq.request_id, "tpserve.seq_id": seq.seq_id},
        )
        queue = self._tracer.start_span("scheduler.queue", context=trace.set_span_in_context(span))
        self._requests[seq.request_id] = _RequestSpans(span, queue)

    def scheduled(self, out: SchedulerOutput) -> None:
        """Events for what a schedule() did to traced requests."""
        if not self._requests:
            return
        for seq in out.admitted:
            r = self._requests.get(seq.request_id)
            if r is not None:
                if r.queue is not None:
                    r.queue.end()
                    r.queue = None
                r.span.add_event("admitted", {"tpserve.num_preemptions": seq.num_preemptions})
        for seq in out.swapped_in:
            r = self._requests.get(seq.request_id)
            if r is not None:
                r.span.add_event("swapped in", {"tpserve.num_computed_tokens": seq.num_computed_tokens})
        swapped = {seq.seq_id for seq in out.swapped_out}
        for seq in out.preempted:
            r = self._requests.get(seq.request_id)
            if r is not None:
                r.span.add_event(
                    "preempted", {"tpserve.kind": "swap" if seq.seq_id in swapped else "recompute"}
                )

    def step_span(self, out: SchedulerOutput):
        """A span for this step when a traced request rides it: a child of the oldest traced request,
        linked from the others (one step serves many traces); None otherwise."""
        if not self._requests:
            return None
        traced = [r.span for s in out.scheduled if (r := self._requests.get(s.seq.request_id)) is not None]
        if not traced:
            return None
        return self._tracer.start_span(
            "scheduler.step",
            context=trace.set_span_in_context(traced[0]),
            links=[trace.Link(span.get_span_context()) for span in traced[1:]],
            attributes={
                "tpserve.batch_size": len(out.scheduled),
                "tpserve.batch_tokens": out.num_batched_tokens,
            },
        )

    def end(self, request_id: str, reason: str) -> None:
        r = self._requests.pop(request_id, None)
        if r is not None:
            if r.queue is not None:
                r.queue.end()
            r.span.add_event("finished", {"tpserve.finish_reason": reason})
            r.span.end()
