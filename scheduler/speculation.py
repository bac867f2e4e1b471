"""Speculative decoding, the scheduler's side: who proposes how many tokens in a step, and what the
verifications did.

A step is bound by reading the weights while its batch is small, so verifying k proposed tokens of a
sequence costs about as much as computing its one next token; each accepted proposal is then a token
for free. The Speculator is the Scheduler's Proposer (scheduler/plan.py): the scheduler asks it for a
decoding sequence's proposals within the step's budget and the sequence's limits, and the engine tells
it, after each step, how many of them the worker accepted. Proposals come from one method:
- ngram: prompt lookup over the sequence's own tokens, here (scheduler/ngram.py);
- draft: a draft model on the shard workers, which proposes in the step itself: the scheduler only
  reserves the positions (DRAFTED placeholders, scheduler/plan.py) and the budget they take.

When not to speculate (each rule skips proposals, never a token):
- per step, when the load is high: while the scheduler holds speculative_disable_by_batch_size sequences
  or more (running, waiting or swapped out), a step is bound by compute, proposals cost what they would
  save, and none are made (bench/speculative.py measures where this lies);
- per sequence, by its recent acceptance: each sequence keeps an exponential average `a` of its chance
  of accepting a proposal it reaches (per verification, accepted / (accepted + 1 if one was rejected);
  starting at 1, each verification weighing ACCEPTANCE_WEIGHT). Its i-th proposal of a step is then
  reached and accepted with a chance of about a^i. A verification costs a fixed part of a decode step
  (VERIFY_COST) and each proposal a little more (PROPOSAL_COST): so a sequence proposes the tokens with
  a^i >= PROPOSAL_COST (4 at a = 0.7, 2 at 0.5), and only if they are expected to bring VERIFY_COST
  tokens (a + a^2 + ... >= VERIFY_COST, so not below a = 0.45). When they are not, it makes no proposals
  the next `backoff` times it is asked for some (steps with speculation on; BACKOFF_STEPS at first,
  doubled each time it falls below again, up to MAX_BACKOFF_STEPS), and resumes with `a` at
  RESUME_ACCEPTANCE, the least that proposes: the
  first verification after the pause decides: a failure pauses it again, twice as long; a success
  starts its backoff over.
Plain Python: no torch, no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.settings import at_least, setting, validate
from scheduler.ngram import NgramIndex
from scheduler.plan import DRAFTED, ScheduledSeq
from scheduler.sequence import Sequence

SPECULATIVE_METHODS = ("none", "ngram", "draft")

# What a verification costs, in decode steps. Measured for SmolLM2-135M on 2 CPU cores (bench/speculative.py's
# step costs): at batch 1, a second query row turns every matrix-vector product into a matrix-matrix one,
# and a step of 2 to 5 query tokens takes 1.4 to 1.7 decode steps, whatever their number; from batch 8 on,
# each further query token per sequence adds 0.1 to 0.25 of a step (more over long contexts, since every
# query token attends over the context).
VERIFY_COST = 0.6
PROPOSAL_COST = 0.2
RESUME_ACCEPTANCE = 0.45  # the least acceptance that still proposes (two tokens, 0.45 + 0.2 >= 0.6)
ACCEPTANCE_WEIGHT = 0.3
BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 64


@dataclass(frozen=True)
class SpeculativePolicy:
    """The knobs of speculative decoding, declared once: `tpserve scheduler` and `tpserve launch` take
    them as flags (common/settings.py). vLLM's names, where it has them (its speculative_config's keys)."""

    speculative_method: str = setting(
        "none",
        help="propose tokens for each step to verify: ngram (prompt lookup) or draft (--speculative-model)",
        choices=SPECULATIVE_METHODS,
        launch=True,
    )
    num_speculative_tokens: int = setting(
        4, help="speculation: most tokens proposed per sequence per step", rule=at_least(1), launch=True
    )
    prompt_lookup_max: int = setting(
        4, help="ngram: the longest suffix looked up in the sequence's tokens", rule=at_least(1), launch=True
    )
    prompt_lookup_min: int = setting(
        2, help="ngram: the shortest suffix looked up", rule=at_least(1), launch=True
    )
    # Measured for SmolLM2-135M on 2 CPU cores (bench/speculative.py's step costs): a step of 16
    # sequences verifying 4 proposals each costs 2.7 decode steps, more than the 2 to 3 tokens a
    # verification yields outside quoting workloads; at 8 it costs 1.9. A GPU stays bound by reading the
    # weights to far larger batches: measure there and raise it.
    speculative_disable_by_batch_size: int = setting(
        16,
        help="speculation: no proposals while the scheduler holds at least this many sequences (0: always)",
        rule=at_least(0),
        launch=True,
    )

    def __post_init__(self):
        validate(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--prompt-lookup-min {self.prompt_lookup_min} must be at most --prompt-lookup-max "
                f"{self.prompt_lookup_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.speculative_method != "none"


@dataclass
class SpeculationTotals:
    """What the verifications did since start (the metrics, GetStats and the benchmark read these)."""

    num_drafts: int = 0  # verifications: sequence-steps that verified at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_emitted_tokens: int = 0  # tokens the verifications produced: the accepted ones and one more each
    # [i]: verifications whose proposal at position i (0-based) was accepted.
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification, the target's own one included (vLLM's mean acceptance length)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _SequenceSpeculation:
    """A sequence's own state (Sequence.proposer_state): it goes with the sequence."""

    ngrams: NgramIndex | None
    acceptance: float = 1.0  # exponential average of its chance of accepting a proposal it reaches
    pause: int = 0  # proposal requests left to refuse (steps with speculation on, not all steps)
    backoff: int = BACKOFF_STEPS  # the next pause's length
    resumed: bool = False  # the next verification is the first after a pause


class Speculator:
    def __init__(self, policy: SpeculativePolicy):
        if not policy.enabled:
            raise ValueError("speculative_method none: no Speculator")
        self.policy = policy
        self.totals = SpeculationTotals(accepted_per_position=[0] * policy.num_speculative_tokens)

    def enabled(self, batch_size: int) -> bool:
        limit = self.policy.speculative_disable_by_batch_size
        return limit == 0 or batch_size < limit

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        state = self._state(seq)
        if state.pause:
            state.pause -= 1
            return []
        k = min(self.policy.num_speculative_tokens, max_tokens, _worth_proposing(state.acceptance))
        if state.ngrams is None:
            return [DRAFTED] * k
        return state.ngrams.propose(seq.token_ids, k)

    def observe(self, sampled: list[ScheduledSeq], tokens: list[list[int]]) -> None:
        """One step's verifications: sampled are the step's sampled sequences, tokens what each got
        (the accepted proposals, then one more)."""
        t = self.totals
        for item, got in zip(sampled, tokens, strict=True):
            proposed = item.num_samples - 1
            if proposed <= 0:
                continue
            accepted = len(got) - 1
            t.num_drafts += 1
            t.num_draft_tokens += proposed
            t.num_accepted_tokens += accepted
            t.num_emitted_tokens += len(got)
            for i in range(accepted):
                t.accepted_per_position[i] += 1
            self._judge(self._state(item.seq), accepted / (accepted + (accepted < proposed)))

    @staticmethod
    def _judge(state: _SequenceSpeculation, share: float) -> None:
        state.acceptance += ACCEPTANCE_WEIGHT * (share - state.acceptance)
        if _worth_proposing(state.acceptance):
            if state.resumed:
                state.backoff = BACKOFF_STEPS
            state.resumed = False
            return
        if state.resumed:  # the first verification after a pause failed too: pause twice as long
            state.backoff = min(2 * state.backoff, MAX_BACKOFF_STEPS)
        state.pause, state.acceptance, state.resumed = state.backoff, RESUME_ACCEPTANCE, True

    def _state(self, seq: Sequence) -> _SequenceSpeculation:
        """The sequence's own state, made at its first proposal."""
        if seq.proposer_state is None:
            p = self.policy
            ngrams = None
            if p.speculative_method == "ngram":
                ngrams = NgramIndex(p.prompt_lookup_min, p.prompt_lookup_max)
            seq.proposer_state = _SequenceSpeculation(ngrams)
        return seq.proposer_state


def _worth_proposing(acceptance: float) -> int:
    """How many proposals to make: those with a chance acceptance^i >= PROPOSAL_COST of being reached
    and accepted (at most 16), or none when they would not bring VERIFY_COST tokens between them."""
    k, expected = 0, 0.0
    while k < 16 and acceptance ** (k + 1) >= PROPOSAL_COST:
        k += 1
        expected += acceptance**k
    return k if expected >= VERIFY_COST else 0
