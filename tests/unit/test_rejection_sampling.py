"""Speculative decoding's acceptance rules keep the target's distribution exactly.

Many draws from a fixed target p with proposals from a draft q: the tokens the rules emit must follow p
(a chi-square test, which the naive rule "accept every proposal" fails: its tokens follow q), at the
first position and, through the sampler's depth loop, at the second one too. Seeded draws are coupled:
with speculation they are the very tokens drawn without it."""

from __future__ import annotations

import torch

from common.sampling import SamplingConfig
from shard_worker.sampling import Sampler
from shard_worker.sampling.draw import draw
from shard_worker.sampling.speculative import draft_tokens, rejection_sample
from shard_worker.step import SequenceInit

VOCAB = 8
DRAWS = 20_000
# The chi-square distribution with VOCAB - 1 = 7 degrees of freedom exceeds this with probability 0.001.
CHI2_7_AT_0_001 = 24.32
P = torch.tensor([0.30, 0.05, 0.20, 0.10, 0.15, 0.02, 0.08, 0.10])
Q = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.05, 0.10, 0.05, 0.10])


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=len(p)).double()
    expected = p.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


def from_q(n: int, seed: int) -> torch.Tensor:
    return torch.multinomial(Q, n, replacement=True, generator=torch.Generator().manual_seed(seed))


def test_the_rejection_rule_emits_tokens_distributed_as_p_and_accept_all_does_not():
    proposals = from_q(DRAWS, seed=1)
    generator = torch.Generator().manual_seed(2)
    tokens = rejection_sample(P.expand(DRAWS, VOCAB), Q.expand(DRAWS, VOCAB), proposals, generator)
    assert chi_square(tokens, P) < CHI2_7_AT_0_001
    # The naive rule keeps every proposal: its tokens follow q.
    assert chi_square(proposals, P) > 100 * CHI2_7_AT_0_001
    # A token equals its proposal exactly when accepted, and acceptance is 1 - TV(p, q).
    accepted = (tokens == proposals).float().mean().item()
    assert abs(accepted - torch.minimum(P, Q).sum().item()) < 0.01


def test_a_point_mass_proposal_is_accepted_with_p_of_it():
    """n-gram proposals: q is a point mass, and the rule is "draw from p, keep it if it is the proposal"."""
    proposals = torch.full((DRAWS,), 2)
    q = torch.nn.functional.one_hot(proposals, VOCAB).float()
    tokens = rejection_sample(P.expand(DRAWS, VOCAB), q, proposals, torch.Generator().manual_seed(3))
    assert chi_square(tokens, P) < CHI2_7_AT_0_001
    assert abs((tokens == 2).float().mean().item() - P[2].item()) < 0.01


def states(config: SamplingConfig, n: int, seeded: bool) -> tuple[Sampler, list]:
    sampler = Sampler(VOCAB)
    sampler._generator.manual_seed(1234)  # unseeded sequences draw from it: the bounds' runs repeat
    inits = [SequenceInit(i, SamplingConfig(**{**config.__dict__, "seed": i if seeded else None}), 0, [3], 1)
             for i in range(n)]  # fmt: skip
    return sampler, [sampler.new_state(init) for init in inits]


def test_seeded_draft_draws_share_the_target_uniforms_so_outputs_equal_no_speculation():
    config = SamplingConfig(temperature=1.0)
    sampler, seqs = states(config, 4000, seeded=True)
    logits_p, logits_q = P.log().expand(len(seqs), VOCAB), Q.log().expand(len(seqs), VOCAB)
    proposals, _ = draft_tokens(seqs, logits_q, 0, torch.Generator())
    without = draw(seqs, logits_p, torch.Generator())  # what a step without speculation draws
    # A verification step: the proposal, then the bonus position (same p there, for the test).
    rows = logits_p.repeat_interleave(2, 0)
    result = sampler.sample(seqs, [2] * len(seqs), [[int(d)] for d in proposals], rows)
    counts = torch.tensor(result.token_counts)
    firsts = torch.tensor(result.token_ids)[counts.cumsum(0) - counts]
    assert torch.equal(firsts, without)
    assert chi_square(without, P) < CHI2_7_AT_0_001
    # A proposal is accepted exactly when the coupled draws agree: whenever p and q put the uniform in
    # the same token (here 0.52 by hand, which no coupling can beat: it is sum(min(p, q))).
    assert torch.equal(counts == 2, proposals == without)
    agree = (proposals == without).float().mean().item()
    assert abs(agree - 0.52) < 0.03


def test_the_sampler_keeps_p_at_the_second_position_too():
    """Through Sampler.sample with the draft's q: two proposals per sequence; the first token follows
    p0, and the second, whenever the first proposal was accepted, follows p1."""
    p1 = torch.tensor([0.10, 0.10, 0.10, 0.40, 0.05, 0.05, 0.15, 0.05])
    sampler, seqs = states(SamplingConfig(temperature=1.0), DRAWS, seeded=False)
    d0, d1 = from_q(DRAWS, seed=4), from_q(DRAWS, seed=5)
    q = [torch.stack([Q, Q]) for _ in seqs]
    rows = torch.stack([P.log(), p1.log(), P.log()]).repeat(DRAWS, 1)  # 3 positions per sequence
    result = sampler.sample(
        seqs, [3] * DRAWS, [[int(a), int(b)] for a, b in zip(d0, d1, strict=True)], rows, q
    )
    starts = torch.tensor(result.token_counts).cumsum(0) - torch.tensor(result.token_counts)
    tokens = torch.tensor(result.token_ids)
    assert chi_square(tokens[starts], P) < CHI2_7_AT_0_001
    second = torch.tensor(result.token_counts) >= 2
    assert second.sum() > DRAWS / 3
    assert chi_square(tokens[starts[second] + 1], p1) < CHI2_7_AT_0_001
    # The first token is the first proposal exactly when the sequence went on to a second.
    assert torch.equal(tokens[starts] == d0, second)
