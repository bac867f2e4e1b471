"""Pooling requests in the scheduler (embeddings, scores): a sequence whose only step computes its whole
prompt, samples nothing, and ends there; the workers' pooled vector goes out with that step's update
(scheduler/reports.py). Its blocks are taken like any prompt's (they bound what a step holds) and go back
through the one release path as soon as the step is applied, never registered for reuse. Plain Python.
"""

from __future__ import annotations

from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_LENGTH
from scheduler.plan import SequenceUpdate
from scheduler.sequence import Sequence


def may_reuse(seq: Sequence) -> bool:
    """Whether a prefix-cache hit may stand in for computing seq's first tokens: not when their logprobs
    are wanted, nor for pooling (an encoder keeps no KV, and the pooled vector reads every row)."""
    return seq.prompt_logprobs is None and not seq.pooling


def end(scheduler, seq: Sequence) -> SequenceUpdate:
    """Ends a pooling sequence after its step (Scheduler.update, overlap.apply): its blocks go back now."""
    scheduler.end(seq, FINISH_REASON_LENGTH)
    return SequenceUpdate(seq, [], True)
