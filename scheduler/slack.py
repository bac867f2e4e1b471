"""The order waiting sequences are admitted in when requests carry priorities and latency objectives.

    slack = first_token_deadline - now - predicted time to its first token
    predicted = steps its remaining prompt needs (chunks of max_num_batched_tokens) * recent step time

Order (a stable sort, so arrival order breaks ties):
1. sequences admitted before (preempted, or back after lost ranks): they were running, and keep their place;
2. urgent ones, whose slack is below one step (they must start now to keep the objective they were
   admitted with), by priority (lower first, vLLM's sense) and then least slack: only a higher priority
   request can delay an urgent one;
3. the rest by priority, then least slack (no objective: no deadline, after those with one), then arrival.
So a stream of higher-priority requests delays a lower-priority one that has an objective only until its
slack runs out; one without an objective may wait behind them as long as they keep coming (as with vLLM's
priority scheduling). With no priorities and no objectives this is first come, first served, unchanged.
Plain Python: the clock is an argument.
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


def slack(seq: Waiting, now: float, step_s: float, tokens_per_step: int) -> float:
    """Seconds to spare before seq must start to make its first-token deadline (inf: none)."""
    if seq.ttft_deadline is None:
        return math.inf
    steps = math.ceil(max(1, seq.num_tokens - seq.num_computed_tokens) / max(1, tokens_per_step))
    return seq.ttft_deadline - now - steps * step_s


def admission_order(waiting: Iterable[Waiting], now: float, step_s: float, tokens_per_step: int) -> list:
    """waiting in the order to admit them (see the module docstring)."""
    seqs = list(waiting)
    if not any(s.priority or s.ttft_deadline is not None for s in seqs):
        return seqs

    def key(s: Waiting):
        spare = slack(s, now, step_s, tokens_per_step)
        urgent = spare <= step_s
        return (not s.admitted_before, not urgent, s.priority, spare)

    return sorted(seqs, key=key)
