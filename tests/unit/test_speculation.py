"""The scheduler's side of speculative decoding, as plain Python: n-gram prompt lookup (incremental, yet
the same proposals as a scan of the whole sequence), the rules of when not to speculate, the counts of
what verifications accepted, and a step that carries a draft model's proposals as counts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from scheduler.batch import StepBuilder
from scheduler.ngram import NgramIndex
from scheduler.plan import DRAFTED, ScheduledSeq
from scheduler.speculation import BACKOFF_STEPS, SpeculativePolicy, Speculator
from tests.unit.fakes import step_arrays
from tests.unit.test_multi_token import make, verify
from tests.unit.test_scheduler import seq


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The proposal by brute force: the longest suffix that occurred before, its latest occurrence, and
    the k tokens after it, the copy running on into itself."""
    end = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        for at in range(end - 1, n - 1, -1):
            if end > n and tokens[at - n : at] == tokens[end - n :]:
                out = []
                for i in range(k):
                    out.append(tokens[at + i] if at + i < end else out[at + i - end])
                return out
    return []


def test_ngram_lookup_finds_the_longest_latest_match():
    index = NgramIndex(1, 3)
    assert index.propose([7, 1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # "1 2" was followed by "3 9 1"
    index = NgramIndex(2, 3)
    # "5 6" twice: the later occurrence (followed by 8) wins; "9 5 6" once, then "7" after it.
    assert index.propose([9, 5, 6, 7, 0, 5, 6, 8, 4, 9, 5, 6], 2) == [7, 0]
    assert NgramIndex(2, 2).propose([1, 2, 3, 4], 3) == []  # nothing repeats
    # A loop: the copy runs on past the end, so a loop of period 2 gets its k proposals.
    assert NgramIndex(2, 2).propose([4, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_incremental_lookup_equals_a_full_scan():
    rng = random.Random(0)
    for trial in range(30):
        tokens = [rng.randrange(6) for _ in range(5)]
        index = NgramIndex(1 + trial % 2, 3)
        for _ in range(60):
            assert index.propose(tokens, 4) == scan(tokens, 4, 1 + trial % 2, 3)
            tokens += [rng.randrange(6) for _ in range(rng.choice([1, 1, 1, 3]))]


def policy(**kw) -> SpeculativePolicy:
    return SpeculativePolicy(**{"speculative_method": "ngram", "num_speculative_tokens": 3, **kw})


def test_policy_refuses_an_empty_lookup_range():
    with pytest.raises(ValueError, match="--prompt-lookup-min 3 must be at most --prompt-lookup-max 2"):
        policy(prompt_lookup_min=3, prompt_lookup_max=2)


def test_no_proposals_in_a_large_batch():
    assert Speculator(policy(speculative_disable_by_batch_size=0)).enabled(10_000)

    def proposals(num_seqs: int) -> int:
        """Proposals over a few steps of this many sequences, with the switch at 4 running ones."""
        draft = SpeculativePolicy(speculative_method="draft", speculative_disable_by_batch_size=4)
        sched = make(Speculator(draft))
        for i in range(num_seqs):
            sched.add(seq(i, 8, max_new=10, ignore_eos=True))
        made = 0
        for _ in range(4):
            out = sched.schedule()
            made += sum(len(item.draft_token_ids) for item in out.scheduled)
            sched.update(out, [verify(i) for i in out.sampled])
        return made

    assert proposals(3) > 0 and proposals(4) == 0


def verified(s, proposed: int, accepted: int) -> tuple[ScheduledSeq, list[int]]:
    """A verification of `proposed` tokens of s that accepted the first `accepted` of them."""
    return ScheduledSeq(s, 1 + proposed, 1 + proposed, [5] * proposed), [5] * (accepted + 1)


def test_a_sequence_proposes_as_far_as_its_acceptance_makes_worthwhile_then_pauses():
    spec = Speculator(policy(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1))
    s = seq(0, 4, max_new=100)
    s.token_ids = [5, 5, 5, 5]  # always something to propose

    def step(accept: bool) -> int:
        """One decode step of s: how many tokens it proposed (all of them then accepted, or none)."""
        proposal = spec.propose(s, 4)
        if proposal:
            item, got = verified(s, len(proposal), len(proposal) if accept else 0)
            spec.observe([item], [got])
        return len(proposal)

    # Every first proposal rejected: acceptance 1 -> 0.7 -> 0.49 -> 0.34, so 4 proposals, 4 (0.7^4 >= 0.2),
    # 2 (0.49 + 0.24 >= 0.6), and then a pause (0.34 alone would not pay for a verification).
    assert [step(False) for _ in range(3)] == [4, 4, 2]
    assert [step(False) for _ in range(BACKOFF_STEPS)] == [0] * BACKOFF_STEPS
    assert step(False) == 2  # the probe after the pause (at 0.45), rejected too: a pause twice as long
    assert [step(False) for _ in range(2 * BACKOFF_STEPS)] == [0] * (2 * BACKOFF_STEPS)
    assert step(True) == 2  # this probe is accepted: the backoff starts over
    assert s.proposer_state.backoff == BACKOFF_STEPS
    # Accepted again and again (0.62, 0.73, ...), it proposes further, up to num_speculative_tokens.
    assert [step(True) for _ in range(5)] == [3, 4, 4, 4, 4]


def test_totals_count_drafts_tokens_and_positions():
    spec = Speculator(policy())
    a, b, c = seq(0, 4, max_new=9), seq(1, 4, max_new=9), seq(2, 4, max_new=9)
    items, tokens = zip(verified(a, 3, 2), verified(b, 2, 0), (ScheduledSeq(c, 1, 1), [7]), strict=True)
    spec.observe(list(items), list(tokens))
    t = spec.totals
    assert (t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens, t.num_emitted_tokens) == (2, 5, 2, 4)
    assert t.accepted_per_position == [1, 1, 0]
    assert t.acceptance_rate == 0.4 and t.mean_accepted_length == 2.0


def test_a_draft_models_proposals_travel_as_counts():
    """DRAFTED placeholders take their positions, budget and sampled rows; the step carries only how many
    the workers' draft model fills in, not ids."""
    sched = make(Speculator(SpeculativePolicy(speculative_method="draft", num_speculative_tokens=2)))
    builder = StepBuilder()
    sched.add(seq(0, 20, max_new=10, ignore_eos=True))
    sched.add(seq(1, 5, max_new=10, ignore_eos=True))
    out = sched.schedule()
    assert builder.build(out).draft_counts == b""  # prompts: nothing proposed, the field stays empty
    sched.update(out, [verify(i) for i in out.sampled])
    out = sched.schedule()
    assert [i.draft_token_ids for i in out.scheduled] == [[DRAFTED] * 2] * 2
    req = builder.build(out)
    arr = step_arrays(req)
    assert arr["query_lens"] == [3, 3] and arr["sample_counts"] == [3, 3]
    # Each sequence's own last token only: its proposals are made on the workers.
    assert arr["input_ids"] == [item.seq.token_ids[-1] for item in out.scheduled]
    assert np.frombuffer(req.draft_counts, "<i8").tolist() == [2, 2]
