"""Pooling requests in the scheduler (embeddings, scores): a sequence whose only step computes its whole
prompt, samples nothing, and ends there; the workers' pooled vector goes out with that step's update
(scheduler/reports.py). Its blocks are taken like any prompt's (they bound what a step holds) and go back
through the one release path as soon as the step is applied, never registered for reuse. Plain Python.
"""

from __future__ import annotations

from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_LENGTH
from scheduler import plan
from scheduler.plan import SchedulerOutput, SequenceUpdate
from scheduler.sequence import Sequence


def may_reuse(seq: Sequence) -> bool:
    """Whether a prefix-cache hit may stand in for computing seq's first tokens: not when their logprobs
    are wanted, nor for pooling (an encoder keeps no KV, and the pooled vector reads every row)."""
    return seq.prompt_logprobs is None and not seq.pooling


def whole(seq: Sequence, num_new: int, start: int) -> int:
    """num_new, or 0 when seq is a pooling sequence whose prompt it does not finish: one runs whole (an
    encoder attends over all of it), in a later step if not in this one."""
    return num_new if not seq.pooling or start + num_new == seq.num_tokens else 0


def generating(scheduler, out: SchedulerOutput, sampled: list[list[int]], updates: list[SequenceUpdate]):
    """plan.live_results (Scheduler.update's and overlap.apply's) for the generation sequences only. Each
    pooling sequence of the step ends here instead, its one step done: its blocks go back now, and its
    update (which the workers' vector goes out with) is appended to updates."""
    for item, tokens in plan.live_results(out, sampled):
        if not item.seq.pooling:
            yield item, tokens
            continue
        scheduler.end(item.seq, FINISH_REASON_LENGTH)
        updates.append(SequenceUpdate(item.seq, [], True))
