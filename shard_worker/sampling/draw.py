"""The draw: temperature, top-k, top-p and min-p, then one token per row by inverse CDF.

Greedy rows in a mixed batch take the argmax of their (processed) logits. A seeded row's uniform comes
from its own (seed, output position); unseeded rows share one generator.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
# How many of a row's best tokens top-k/top-p look at before falling back to sorting the whole row.
CANDIDATES = 256


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _uniform(bits: int) -> float:
    return (bits >> 11) * 2.0**-53  # the top 53 bits as a float in [0, 1)


def draw_seed(seed: int, n: int) -> int:
    """The generator seed for a seeded sequence's n-th draw (0-based). Mixed so that nearby (seed, n)
    pairs give unrelated streams."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(n))


def seeded_uniform(seed: int, n: int) -> float:
    """The uniform number a seeded sequence draws its output position n with."""
    return _uniform(draw_seed(seed, n))


def greedy_or_draw(states, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row: the argmax for greedy rows, a draw for the others."""
    cfgs = [s.config for s in states]
    sampled = draw(states, logits, generator)
    if not any(c.greedy for c in cfgs):
        return sampled
    greedy = torch.tensor([c.greedy for c in cfgs], dtype=torch.bool, device=logits.device)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def draw(states, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    probs = probabilities([s.config for s in states], logits)
    return inverse_cdf(probs, uniforms(states, generator))


def probabilities(cfgs, logits: torch.Tensor) -> torch.Tensor:
    """What each row draws from: its logits at its temperature, then top-k, top-p and min-p, as
    probabilities (greedy rows get temperature 1 and no filters: their draw is discarded)."""
    device, vocab_size = logits.device, logits.shape[1]
    temperature = column([1.0 if c.greedy else c.temperature for c in cfgs], device)
    scaled = logits / temperature
    top_k = [c.top_k if not c.greedy and 0 < c.top_k < vocab_size else 0 for c in cfgs]
    top_p = [c.top_p if not c.greedy else 1.0 for c in cfgs]
    if any(top_k) or any(p < 1.0 for p in top_p):
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    min_p = [0.0 if c.greedy else c.min_p for c in cfgs]
    if any(min_p):
        # Relative to the most likely token, which every filter keeps, so renormalisation after
        # top-k/top-p does not change which tokens survive.
        floor = column(min_p, device) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def uniforms(states, generator: torch.Generator, ahead: int = 0) -> torch.Tensor:
    """One uniform per row: a seeded row's from (seed, its output position num_sampled + ahead), the
    others' from the shared generator. `ahead` is for a draft model proposing a later position."""
    cfgs = [s.config for s in states]
    device = generator.device
    u = torch.rand(len(states), device=device, generator=generator)
    seeded = [i for i, c in enumerate(cfgs) if c.seed is not None and not c.greedy]
    if seeded:
        # The one loop per row: a seeded sequence's uniform comes from its own (seed, position).
        values = [seeded_uniform(cfgs[i].seed, states[i].num_sampled + ahead) for i in seeded]
        u.index_copy_(
            0, torch.tensor(seeded, device=device), torch.tensor(values, dtype=u.dtype, device=device)
        )
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token where the row's cumulative mass (over the vocab in id order) passes u times the
    row's total (which need not be 1). searchsorted with right=True never lands on a token of probability
    zero, since the CDF does not rise there."""
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # A draw that rounds up to the whole mass (u of 1 - 2^-53 is 1.0 in float32) lands past every
    # token: it belongs to the last token that has any probability, never to one outside the kept set.
    last_kept = probs.shape[1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return torch.minimum(sampled, last_kept)


def _top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Sets the logits of tokens outside each row's top-k / top-p set to -inf.

    Sorting a whole vocab row is the expensive part, and the kept set is usually small: the CANDIDATES
    best tokens are used instead whenever they provably contain every row's kept set, and the full sort
    only otherwise. Both give the same set.
    """
    device, vocab_size = scaled.device, scaled.shape[1]
    filtered = torch.tensor([k > 0 or p < 1.0 for k, p in zip(top_k, top_p, strict=True)], device=device)
    k = torch.tensor([k or vocab_size for k in top_k], dtype=torch.long, device=device)
    p = column(top_p, device)
    # The top-p mass is measured over the top-k set when there is one, else over the whole row.
    needs_full_lse = any(kk == 0 and pp < 1.0 for kk, pp in zip(top_k, top_p, strict=True))
    full_lse = torch.logsumexp(scaled, dim=-1) if needs_full_lse else scaled.new_zeros(len(top_k))
    kept = None
    if vocab_size > CANDIDATES:
        values, order = scaled.topk(CANDIDATES, dim=-1)
        kept, covered = _keep_sorted(values, k, p, full_lse, vocab_size)
        if not bool((covered | ~filtered).all()):
            kept = None
    if kept is None:
        values, order = scaled.sort(dim=-1, descending=True)
        kept, _ = _keep_sorted(values, k, p, full_lse, vocab_size)
    out = torch.full_like(scaled, float("-inf")).scatter_(-1, order, kept)
    return torch.where(filtered.unsqueeze(1), out, scaled)


def _keep_sorted(values, k, p, full_lse, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values: each row's best n logits, descending. Returns them with the dropped ones at -inf, and per
    row whether these n were enough to decide its kept set exactly."""
    n = values.shape[1]
    rank = torch.arange(n, device=values.device)
    values = values.masked_fill(rank >= k[:, None], float("-inf"))
    has_top_k = k < vocab_size
    lse = torch.where(has_top_k, torch.logsumexp(values, dim=-1), full_lse)
    probs = torch.exp(values - lse[:, None])
    cum = probs.cumsum(dim=-1)
    # A token stays if the tokens ranked above it sum to less than top_p; the first always stays.
    values = values.masked_fill(cum - probs >= p, float("-inf"))
    covered = (has_top_k & (k <= n)) | (~has_top_k & (cum[:, -1:] >= p).squeeze(1))
    return values, covered


def column(values: list[float], device) -> torch.Tensor:
    """Per-row values as a [rows, 1] float32 column, to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
