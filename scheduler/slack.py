"""The order waiting sequences are admitted in when requests carry priorities and latency objectives.

    slack = first_token_deadline - now - predicted time to its first token
    predicted = steps its remaining prompt needs (chunks of max_num_batched_tokens) * recent step time

Order (a stable sort, so arrival order breaks ties):
1. urgent ones, whose slack is below one step (they must start now to keep the objective they were
   admitted with), by priority (lower first, vLLM's sense) and then least slack: only a higher priority
   request can delay an urgent one;
2. the rest by priority; within one priority, sequences admitted before (preempted, or back after lost
   ranks: they were running, and keep their place) first, then least slack (no objective: no deadline,
   after those with one), then arrival.
A deadline is for the first token: a sequence that has produced one (here, or before a failover resumed
it) has no slack to lose and is never urgent. So a stream of higher-priority requests delays a
lower-priority one that has an objective only until its slack runs out; one without an objective may wait
behind them as long as they keep coming (as with vLLM's priority scheduling). A preempted sequence keeps
its place against later arrivals of its own or lower priority, not against a higher priority (which is
what may preempt it: scheduler/priority.py). With no priorities and no objectives this is first come,
first served, unchanged. Plain Python: the clock is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol


class Waiting(Protocol):
    priority: int
    ttft_deadline: float | None  # monotonic time its first token is due; None: no objective
    admitted_before: bool
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...


def slack(seq: Waiting, now: float, step_s: float, tokens_per_step: int) -> float:
    """Seconds to spare before seq must start to make its first-token deadline (inf: none, or its first
    token is out already)."""
    if seq.ttft_deadline is None or seq.num_output_tokens > 0:
        return math.inf
    steps = math.ceil(max(1, seq.num_tokens - seq.num_computed_tokens) / max(1, tokens_per_step))
    return seq.ttft_deadline - now - steps * step_s


def order_key(seq: Waiting, now: float, step_s: float, tokens_per_step: int) -> tuple:
    """Where seq goes in the admission order (smaller first; see the module docstring)."""
    spare = slack(seq, now, step_s, tokens_per_step)
    return (spare > step_s, seq.priority, not seq.admitted_before, spare)


def admission_order(waiting: Iterable[Waiting], now: float, step_s: float, tokens_per_step: int) -> list:
    """waiting in the order to admit them (see the module docstring)."""
    seqs = list(waiting)
    if not any(s.priority or s.ttft_deadline is not None for s in seqs):
        return seqs
    return sorted(seqs, key=lambda s: order_key(s, now, step_s, tokens_per_step))
