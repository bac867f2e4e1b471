"""Async scheduling (--async-scheduling; vLLM's name, SGLang's overlap loop): step N+1 is planned, built,
serialized and sent while the ranks run step N, so the scheduler's host work and the hop to the ranks
hide behind the forward. One step in flight ahead, never more:

    send(first step)
    loop: plan N+1, send it; receive N, apply it, publish it

N's tokens are not known when N+1 is planned. When N is sent, each of its sequences has its
num_computed_tokens advanced, and each one that samples gets a PLACEHOLDER token appended (num_pending):
planned against those, N+1 computes the placeholder, and each rank puts in the token rank 0 sampled for
that sequence in N (shard_worker/worker.py). The workers already keep every sequence's sampler state
between steps (penalties, min_tokens, seeded draws and grammars are updated from each token sampled,
and a sequence is sent whole only once), so nothing else is sent twice.

When N's reply comes, each placeholder is replaced by its token and the stop conditions are checked. A
sequence that ended (EOS, a length, an abort) while N+1 was in flight gets nothing from N+1 (its token
there is dropped: no token after the end), and its blocks go back to the pool once, after N+1 returned
(BlockManager.step_sent / step_returned), as do those of a sequence preempted while a step in flight
computes for it. A sequence preempted with a token pending still gets that token, from its step's reply.

Steps with a grammar sequence are not planned ahead of: the step after one is planned once it returned
(the grammar may have ended the sequence). Speculative decoding is refused with async scheduling
(config.py), as vLLM does. A lost rank drops the placeholders, and every sequence is recomputed from
the tokens known, as in the serial loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common import tracing
from scheduler import pooling
from scheduler.plan import SchedulerOutput, SequenceUpdate
from scheduler.reports import StepResult
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceStatus
from scheduler.workers import WorkersLost

# In a StepRequest's input_ids: the token the sequence's previous step samples, put in by the ranks.
PLACEHOLDER = -1


@dataclass
class SentStep:
    out: SchedulerOutput
    step_id: int
    span: object  # the step's trace span (None without tracing), ended when its replies come
    sent_at: float


class OverlapLoop:
    """The engine's step loop with one step in flight ahead (scheduler/engine.py runs it in place of the
    serial loop)."""

    def __init__(self, engine):
        self.engine = engine
        self._last_reply = 0.0

    async def run(self) -> None:
        ahead: SentStep | None = None
        try:
            while True:
                if ahead is not None and any(i.seq.has_grammar or i.seq.pooling for i in ahead.out.scheduled):
                    await self._apply(ahead)  # a grammar may end its sequence, pooling does: no step ahead
                    ahead = None
                out = await self.engine._next_batch() if ahead is None else self._plan()
                sent = await self._send(out) if out is not None and not out.is_empty else None
                if ahead is not None:
                    await self._apply(ahead)
                ahead = sent
        except WorkersLost:
            self._abandon()
            raise

    def _plan(self) -> SchedulerOutput | None:
        """The next step, planned while one is in flight; None while min_batch_size would wait (the loop
        then waits in _next_batch once the step in flight is applied)."""
        e = self.engine
        e._wakeup.clear()
        e.workers.check()
        now = time.monotonic()
        if e.scheduler.batch_wait_deadline(now, e.routers.queued(), e.admission_depth) is not None:
            return None
        out = e.scheduler.schedule(now)
        e._scheduled(out, now)
        return out

    async def _send(self, out: SchedulerOutput) -> SentStep:
        e = self.engine
        request = e._builder.build(out)
        span = e.spans.step_span(out)
        if span is not None:
            request.trace_context.update(tracing.carrier(span))
        data = request.SerializeToString()
        advance(out)
        e.scheduler.blocks.step_sent(request.step_id, (i.seq.seq_id for i in out.scheduled))
        await e.workers.send(data)
        return SentStep(out, request.step_id, span, time.perf_counter())

    async def _apply(self, sent: SentStep) -> None:
        e = self.engine
        try:
            replies = await e.workers.receive(sent.step_id)
        finally:
            if sent.span is not None:
                sent.span.end()
        updates = apply(e.scheduler, sent.out, e._sampled(sent.out, replies))
        e.scheduler.blocks.step_returned(sent.step_id)
        e._grammars(replies[0])
        # The step's own time: from when the ranks could start it (sent, and the step before answered).
        now = time.perf_counter()
        seconds, self._last_reply = now - max(sent.sent_at, self._last_reply), now
        e._publish(StepResult(sent.out, updates, replies, seconds))

    def _abandon(self) -> None:
        """The ranks were lost with steps in flight: their tokens will never come."""
        sched = self.engine.scheduler
        if sched is None:
            return
        for seq in sched.sequences():
            drop_placeholders(seq)
        sched.blocks.step_returned(None)


def advance(out: SchedulerOutput) -> None:
    """What a step sent computes counts as computed, and each sample it makes as a placeholder."""
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        if item.num_samples:
            seq.token_ids.append(PLACEHOLDER)
            seq.num_pending += 1


def drop_placeholders(seq) -> None:
    if seq.num_pending:
        del seq.token_ids[-seq.num_pending :]
        seq.num_pending = 0


def apply(sched: Scheduler, out: SchedulerOutput, sampled: list[list[int]]) -> list[SequenceUpdate]:
    """Scheduler.update for a step sent ahead (advance() counted its computation when it was sent): each
    sampled token replaces its sequence's first placeholder, then the stop conditions are checked.
    Sequences that ended meanwhile are skipped: their tokens are dropped."""
    updates = []
    # A pooling sequence ends here (no step was planned ahead of its one step).
    for item, tokens in pooling.generating(sched, out, sampled, updates):
        seq = item.seq
        seq.prompt_logprobs_done += item.num_prompt_logprobs
        known = seq.num_tokens - seq.num_pending
        if tokens:
            seq.token_ids[known] = tokens[0]
            seq.num_pending -= 1
            known += 1
        if seq.status is SequenceStatus.RUNNING:
            # Blocks of tokens known and computed (or being computed by the step in flight, which the
            # ranks finish before any later step reads them) become reusable by later prompts.
            sched.blocks.register_full_blocks(seq, min(seq.num_computed_tokens, known))
        if not tokens:
            continue
        reason = sched._stop_reason(seq, tokens[0])
        if reason is not None:
            drop_placeholders(seq)  # the step in flight's token for it is past its end
            sched.end(seq, reason)
        updates.append(SequenceUpdate(seq, tokens, reason is not None))
    return updates
