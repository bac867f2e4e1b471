"""Priority in the running batch: a waiting request of higher priority takes the place of the lowest one.

vLLM's priority scheduling (lower value first, default 0) preempts, when the waiting request it would
admit next does not fit, running requests of lower priority, the latest arrival among equals. Here:
- `running` is kept in priority order, then admission order (`insert`), so its last sequence is the one
  to give way, whether blocks run short for a running sequence (the existing newest-first rule, unchanged
  without priorities) or a waiting one of higher priority needs room (`victim`);
- a running sequence is preempted for a waiting one only by a strictly higher priority (never by an equal
  or a lower one: an accepted request keeps the objective it was admitted with, unless a higher priority
  needs its place), and only if the waiting one would be admitted before it were it waiting too
  (scheduler/slack.py's order: an urgent sequence, about to miss its first-token deadline, is not
  displaced by one that is not). Otherwise the victim, back in the queue, would be admitted again at
  once and preempted again: thrashing;
- swapped sequences come back before new ones, except before one of strictly higher priority
  (`yields_to`), which would only preempt them again.
The victim is preempted as any other (swapped out when the host has room, else recomputed later), and its
own priority and arrival keep its place among those waiting. Plain Python: no torch, no gRPC.
"""

from __future__ import annotations

from bisect import insort_right

from scheduler.block_manager import BlockManager
from scheduler.policy import SchedulingPolicy
from scheduler.sequence import Sequence
from scheduler.slack import order_key


def insert(running: list[Sequence], seq: Sequence) -> None:
    """Adds seq to the running batch after every running sequence of its priority or a higher one."""
    insort_right(running, seq, key=lambda s: s.priority)


def yields_to(seq: Sequence, head: Sequence | None) -> bool:
    """Whether seq (swapped out) waits for head (the next to admit): head has strictly higher priority."""
    return head is not None and head.priority < seq.priority


def victim(
    running: list[Sequence], head: Sequence, now: float, step_s: float, tokens_per_step: int
) -> Sequence | None:
    """The running sequence head may preempt to get a place, or None: from the end of running (in
    `insert`'s order), the first of strictly lower priority that head would go before in the queue (one
    about to miss its first-token deadline keeps its place before one that is not)."""
    mine = order_key(head, now, step_s, tokens_per_step)
    for seq in reversed(running):
        if seq.priority <= head.priority:
            return None
        if mine < order_key(seq, now, step_s, tokens_per_step):
            return seq
    return None


def fits(
    head: Sequence, running: list[Sequence], blocks: BlockManager, max_num_seqs: int, reserve: int, chunk: int
) -> bool:
    """Whether head can be admitted beside running: a free slot, and blocks for its first chunk (its
    cached prefix, then up to chunk tokens) once every running sequence has its next token's, with
    reserve blocks to spare."""
    if len(running) >= max_num_seqs:
        return False
    decodes = sum(blocks.blocks_needed(s, s.num_computed_tokens + 1) for s in running)
    cached = blocks.match_prefix(head) if head.prompt_logprobs is None else 0
    first = min(head.num_tokens, cached + chunk)
    return blocks.can_allocate(head, first, reserve + decodes, num_cached_tokens=cached)


def to_preempt(
    head: Sequence | None,
    running: list[Sequence],
    blocks: BlockManager,
    policy: SchedulingPolicy,
    reserve: int,
    now: float,
    step_s: float,
) -> Sequence | None:
    """The running sequence to preempt now for head, the next to admit (None: none waits, head fits, or
    it outranks none): `victim`, while head does not `fit`."""
    if head is None:
        return None
    tokens = policy.max_num_batched_tokens
    v = victim(running, head, now, step_s, tokens)
    if v is None or fits(head, running, blocks, policy.max_num_seqs, reserve, tokens):
        return None
    return v


def preemptible(running: list[Sequence], best_priority: int | None) -> int:
    """How many running sequences a request of best_priority (the best a router queues; None: none)
    would outrank: places the scheduler's credit offers it beyond the free slots."""
    if best_priority is None:
        return 0
    return sum(1 for s in running if s.priority > best_priority)
