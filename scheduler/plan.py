"""One iteration's plan and what it did, as the scheduler hands them to the engine: which sequences run
and how many tokens each computes and samples, who was preempted, swapped or admitted, the block copies
to make; the counts every report reads; the tokens each sequence gained. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step: a decode's 1 (plus proposals), or a prompt chunk
    num_samples: int  # positions sampled: 0 mid-prompt, else 1 + len(draft_token_ids)
    # Proposed continuations verified this step (speculative decoding): the last tokens of the query, or
    # DRAFTED placeholders for tokens the workers' draft model proposes in the step itself.
    draft_token_ids: list[int] = field(default_factory=list)
    # Query positions that return prompt logprobs: the last ones before min(end, num_prompt_tokens - 1).
    num_prompt_logprobs: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # Every sequence preempted this step; those swapped to host are also in swapped_out, the others
    # will be recomputed.
    preempted: list[Sequence] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    # Swapped sequences back on the device this step (they are scheduled too).
    swapped_in: list[Sequence] = field(default_factory=list)
    # Block copies every rank makes before this step's forward: (device block, host block) out, then
    # (host block, device block) in: preempted sequences swapped out and back, and the prefix cache's
    # host tier (evicted blocks kept, matched ones restored). No host block is both read and written in
    # one step (scheduler/swap.py).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The same for recurrent-state slots (scheduler/state_slots.py): (device, host) out, (host, device) in.
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Sequences admitted from the waiting queue this step (first time, or back after a preemption).
    admitted: list[Sequence] = field(default_factory=list)
    # Of those, the ones admitted for the first time (their queue time ends now).
    first_admitted: list[Sequence] = field(default_factory=list)
    # Sequences the workers may forget (finished or aborted since the last step).
    forgotten_seq_ids: list[int] = field(default_factory=list)
    # Static mode: nothing to run now, but a batch may start at this time even if not full.
    wake_at: float | None = None
    # Waiting sequences whose grammar rank 0 has not reported ready (introduced to it if new).
    grammar_waiting: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def sampled(self) -> list[ScheduledSeq]:
        """The scheduled sequences that sample this step, in batch order (the workers' answer order)."""
        return [s for s in self.scheduled if s.num_samples]

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do: no sequence to compute, no block to copy, no grammar to await."""
        return not (
            self.scheduled or self.swap_out or self.swap_in or self.state_swap_out or self.grammar_waiting
        )

    @property
    def only_grammars(self) -> bool:
        """The step only introduces or awaits grammars: rank 0 may wait for one before answering."""
        return bool(self.grammar_waiting) and not (self.scheduled or self.swap_out or self.swap_in)


@dataclass(frozen=True)
class SchedulerSnapshot:
    waiting: int  # sequences waiting for admission: new, or preempted to be recomputed
    running: int  # sequences in the running batch
    swapped: int  # preempted sequences whose KV is on host blocks, waiting to come back
    kv_blocks_total: int
    kv_blocks_free: int  # blocks no sequence holds (cached prefixes nobody holds count as free)
    num_preemptions: int  # since start
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int  # of those, tokens found cached
    prefix_cache_blocks: int  # blocks holding reusable prefixes
    # The host tier (--host-prefix-cache): prompt tokens the device did not serve, looked up there, and
    # found there; blocks it caches; device blocks copied into it and back since start.
    host_cache_queries: int = 0
    host_cache_hits: int = 0
    host_cache_blocks: int = 0
    offloaded_blocks: int = 0
    restored_blocks: int = 0

    @property
    def in_flight(self) -> int:
        """Every sequence the scheduler holds."""
        return self.waiting + self.running + self.swapped


def check_sampled(out: SchedulerOutput, sampled: list[list[int]]) -> None:
    """Raises ValueError unless sampled has one group per sampling sequence of the step, each of 1 to
    num_samples tokens (the proposals accepted, then one more): a reply is checked whole before any
    sequence changes, so a malformed one leaves the state as it was."""
    items = out.sampled
    if len(sampled) != len(items):
        raise ValueError(f"{len(sampled)} token groups for {len(items)} sampled sequences")
    for item, tokens in zip(items, sampled, strict=True):
        if not 1 <= len(tokens) <= item.num_samples:
            raise ValueError(
                f"seq {item.seq.seq_id}: {len(tokens)} tokens for {item.num_samples} sampled positions"
            )


def live_results(out: SchedulerOutput, sampled: list[list[int]]):
    """(item, its sampled tokens: none for a sequence that samples nothing this step) of each scheduled
    sequence not finished since the step was planned (aborted meanwhile: its tokens are dropped), in
    order. The whole reply is checked (check_sampled) before the first is given, so before any caller
    changes a sequence."""
    check_sampled(out, sampled)
    tokens_of = iter(sampled)
    for item in out.scheduled:
        tokens = next(tokens_of) if item.num_samples else []
        if not item.seq.is_finished:
            yield item, tokens


def split_sampled(out: SchedulerOutput, counts, ids) -> list[list[int]]:
    """A step's sampled tokens (flat ids, and how many each sampling sequence got) per sequence, checked
    whole (check_sampled); ValueError when they do not fit the step."""
    if sum(counts) != len(ids):
        raise ValueError(f"{len(ids)} tokens but counts summing to {sum(counts)}")
    tokens, at = [], 0
    for n in counts:
        tokens.append(list(ids[at : at + n]))
        at += n
    check_sampled(out, tokens)
    return tokens


@dataclass
class SequenceUpdate:
    seq: Sequence
    new_tokens: list[int]  # appended this step (a stop inside a worker's answer drops the rest)
    finished: bool


# A proposal the scheduler reserves the position (and the budget) of, and the shard workers' draft model
# fills in when it runs, in the step (StepRequest.draft_counts).
DRAFTED = -1


class Proposer(Protocol):
    """Proposes tokens likely to follow a sequence, for the step to verify (speculative decoding)."""

    def enabled(self, batch_size: int) -> bool:
        """Whether a step makes proposals at all, while the scheduler holds this many sequences (running,
        waiting or swapped out: the batch it is forming, and those the batch would take next)."""
        ...

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most max_tokens ids (or DRAFTED placeholders); empty when there is nothing worth proposing."""
        ...
