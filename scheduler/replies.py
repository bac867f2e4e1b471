"""Rank 0's reply to a step, checked whole against the step before the scheduler changes anything.

Every later reader of the reply (Scheduler.update, reports.py's logprobs, the grammar news) indexes it
as the step planned it: tokens per sampled sequence, logprobs per token, alternatives per token of a
sequence that asked, prompt-logprob rows per sequence. A reply that does not fit (a rank with a bug, a
version skew, a corrupted stream) is the rank's failure: MalformedReply, a WorkersLost, so the requests
resume on the rebuilt group with the tokens the scheduler holds, and none sees half a step. Plain Python.
"""

from __future__ import annotations

import math

from common.pb.tpserve.internal.v1 import worker_pb2
from scheduler.plan import SchedulerOutput, split_sampled
from scheduler.workers import WorkersLost


class MalformedReply(WorkersLost):
    """A rank's reply does not fit the step it answers."""


def sampled_tokens(
    out: SchedulerOutput, reply: worker_pb2.StepResponse, vocab_size: int = 0, next_seq_id: int | None = None
) -> list[list[int]]:
    """Rank 0's tokens per sampled sequence, once every field of its reply has been checked against the
    step (check_reply); MalformedReply naming the first field that does not fit."""
    try:
        tokens = split_sampled(out, reply.token_counts, reply.token_ids)
        check_reply(out, reply, vocab_size, next_seq_id)
    except ValueError as e:
        raise MalformedReply(f"rank 0's reply does not fit the step: {e}") from None
    return tokens


def check_reply(
    out: SchedulerOutput, reply: worker_pb2.StepResponse, vocab_size: int = 0, next_seq_id: int | None = None
) -> None:
    """ValueError unless the reply's arrays have the sizes the step implies, its token ids are below
    vocab_size (0: unchecked) and the sequences it names are ones the scheduler made (ids below
    next_seq_id; None: unchecked). Token groups are split_sampled's to check."""
    sampled = out.sampled
    n_tokens = len(reply.token_ids)
    # Logprobs: one per token once any sampled sequence asked, with its top_logprobs alternatives for
    # each of its tokens (the sampler's SampleResult); none otherwise.
    wanted = any(item.seq.top_logprobs for item in sampled)
    alternatives = sum(c * item.seq.top_logprobs for item, c in zip(sampled, reply.token_counts, strict=True))
    _sized("logprobs", reply.logprobs, n_tokens if wanted else 0)
    _sized("top_token_ids", reply.top_token_ids, alternatives if wanted else 0)
    _sized("top_logprobs", reply.top_logprobs, alternatives if wanted else 0)
    # Prompt logprobs: a row per position the step asked for, each with its sequence's alternatives.
    rows = sum(item.num_prompt_logprobs for item in out.scheduled)
    prompt_alternatives = sum(
        item.num_prompt_logprobs * (item.seq.prompt_logprobs or 0) for item in out.scheduled
    )
    _sized("prompt_logprobs", reply.prompt_logprobs, rows)
    _sized("prompt_ranks", reply.prompt_ranks, rows)
    _sized("prompt_top_token_ids", reply.prompt_top_token_ids, prompt_alternatives)
    _sized("prompt_top_logprobs", reply.prompt_top_logprobs, prompt_alternatives)
    if vocab_size:
        for field in ("token_ids", "top_token_ids", "prompt_top_token_ids"):
            ids = getattr(reply, field)
            if ids and max(ids) >= vocab_size:
                raise ValueError(f"{field} holds {max(ids)}, beyond the vocabulary of {vocab_size}")
    if next_seq_id is not None:
        named = list(reply.grammar_ready_seq_ids) + [e.seq_id for e in reply.grammar_errors]
        if named and max(named) >= next_seq_id:
            raise ValueError(f"sequence {max(named)} was never scheduled (ids below {next_seq_id})")
    check_timings(reply)


def check_timings(reply: worker_pb2.StepResponse) -> None:
    """Every rank's times (they feed the metrics and the step-time estimates): finite, not negative."""
    for name in ("forward_seconds", "allreduce_seconds"):
        value = getattr(reply, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} is {value}")


def check_replies(out: SchedulerOutput, replies, vocab_size: int, next_seq_id: int) -> list[list[int]]:
    """Every rank's reply checked (rank 0's whole, the others' times); rank 0's tokens per sampled
    sequence. MalformedReply naming the rank and the field."""
    tokens = sampled_tokens(out, replies[0], vocab_size, next_seq_id)
    for rank, reply in enumerate(replies[1:], start=1):
        try:
            check_timings(reply)
        except ValueError as e:
            raise MalformedReply(f"rank {rank}'s reply does not fit the step: {e}") from None
    return tokens


def _sized(name: str, values, expected: int) -> None:
    if len(values) != expected:
        raise ValueError(f"{len(values)} {name} where the step implies {expected}")
