"""Speculative decoding on rank 0: how a draft model's proposals are drawn, and the rule by which the
target accepts them so that every token it emits is distributed exactly as without speculation.

By the sequence's sampling:
- greedy: the draft proposes its argmax; the target accepts the longest prefix equal to its own argmax,
  then adds its next token (the sampler's loop: go on while the token equals the proposal).
- seeded: coupled draws. The draft draws its proposal for output position i by inverse CDF with the
  uniform the target draws position i with, the one of (seed, i) (draw.py); the target draws its own
  token with that uniform and accepts the proposal iff the two are equal. Its tokens are then those of
  a run without speculation, token for token, so seeded requests stay reproducible whether or not
  speculation ran, and a proposal is accepted whenever q puts the uniform in the same token as p does,
  which is often when the draft is close to the target.
- unseeded: the standard rejection rule (Leviathan et al.; Chen et al., 2023): a proposal d drawn from
  q is accepted with probability min(1, p(d)/q(d)); at the first rejection the target draws from the
  normalised positive part of p - q instead, and stops. Each emitted token is then distributed as p,
  and a proposal is accepted with probability 1 - TV(p, q), the most any exact rule allows.
For n-gram proposals q is a point mass at d: min(1, p(d)) = p(d), and (p - q)+ is p without d: "draw
from p, accept iff equal" is this very rule, so such proposals need nothing from this module (and
seeded requests get the coupled rule with them for free).

The draft's q is its logits at the request's temperature, top-k, top-p and min-p (draw.probabilities).
The logits processors (penalties, logit_bias, min_tokens, bad words) are not applied to it, since their
state follows accepted tokens: a request that uses them may see fewer proposals accepted, never other
tokens, since p always has them.
"""

from __future__ import annotations

import torch

from common.sampling import SamplingConfig
from shard_worker.sampling.draw import inverse_cdf, probabilities, uniforms


def uses_rejection(config: SamplingConfig) -> bool:
    """Whether a draft model's proposals for this sequence are judged by the rejection rule (unseeded
    sampling), which needs the draft's q; greedy and seeded ones are judged by equality."""
    return not config.greedy and config.seed is None


def draft_tokens(
    states, logits: torch.Tensor, ahead: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft model's proposals at one depth, a row per state: the argmax for greedy rows, else a
    draw from q by inverse CDF with the uniform of output position num_sampled + ahead. Returns the
    tokens and q (None when every row is greedy)."""
    logits = logits.float()
    cfgs = [s.config for s in states]
    argmax = logits.argmax(dim=-1)
    if all(c.greedy for c in cfgs):
        return argmax, None
    q = probabilities(cfgs, logits)
    drawn = inverse_cdf(q, uniforms(states, generator, ahead))
    greedy = torch.tensor([c.greedy for c in cfgs], dtype=torch.bool, device=logits.device)
    return torch.where(greedy, argmax, drawn), q


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, proposals: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Per row: the proposal, with probability min(1, p/q) at it; otherwise a draw from (p - q)+,
    normalised. p and q are [n, vocab] (each row's total need not be 1), proposals [n] were drawn from
    q. A row's token equals its proposal exactly when it was accepted: (p - q)+ is 0 at a rejected one."""
    p = p / p.sum(dim=-1, keepdim=True)
    q = q / q.sum(dim=-1, keepdim=True)
    d = proposals.unsqueeze(1)
    p_d, q_d = p.gather(1, d).squeeze(1), q.gather(1, d).squeeze(1)
    u = torch.rand(len(proposals), device=p.device, generator=generator)
    accepted = u * q_d < p_d  # u < p/q, without dividing (q_d > 0: d was drawn from q)
    residual = (p - q).clamp_min(0.0)
    # Where p <= q everywhere (p == q but for rounding) a rejection comes only from rounding: p without
    # the proposal is then the draw.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p.scatter(1, d, 0.0), residual)
    redrawn = inverse_cdf(residual, torch.rand(len(proposals), device=p.device, generator=generator))
    return torch.where(accepted, proposals, redrawn)
