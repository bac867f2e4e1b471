"""Chooses the next token of each sequence in a step from its logits (rank 0 only).

The sampler keeps what a sequence's sampling needs between steps: its SamplingConfig, how many
alternatives to report, which tokens it has seen (for the penalties) and how many tokens it has drawn.
Everything else is vectorised over the batch.

Randomness: a token is drawn by inverse CDF from one uniform number per sequence (the CDF runs over the
vocab in id order, row by row, so a row's result does not depend on the others). Unseeded sequences take
their uniforms from one shared generator in one call. A seeded sequence's n-th uniform is a hash of
(seed, n) computed in Python: it does not depend on what else is in the batch or on the device, and a
sequence rebuilt with num_sampled=k continues exactly where it left off without replaying k draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from common.sampling import SamplingConfig
from shard_worker.step import SequenceInit

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


class SampleResult(NamedTuple):
    token_ids: list[int]  # one per sequence, in the order asked
    logprobs: list[float]  # the chosen tokens' logprobs; empty when no sequence asked for logprobs
    top_token_ids: list[int]  # per sequence its top_logprobs best ids, concatenated
    top_logprobs: list[float]


@dataclass
class _Sequence:
    config: SamplingConfig
    top_logprobs: int
    num_sampled: int
    penalty_slot: int | None  # its row in the penalty tables, if it has penalties


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._seqs: dict[int, _Sequence] = {}
        # Shared by unseeded sequences; seeded from the OS, since they promise no reproducibility.
        self._generator = torch.Generator(self.device)
        self._generator.seed()
        # Penalty tables, one row per sequence with penalties: output-token counts (presence/frequency)
        # and whether a token occurred in the prompt or output (repetition). Rows are reused.
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self._seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._free_slots: list[int] = []

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def add(self, init: SequenceInit) -> None:
        """Starts tracking a sequence (or rebuilds one: a known seq_id is replaced)."""
        self.remove(init.seq_id)
        cfg = init.sampling
        slot = None
        if cfg.has_penalties:
            slot = self._take_slot()
            tokens = torch.tensor(init.token_ids, dtype=torch.long, device=self.device)
            self._seen[slot, tokens] = True
            output = tokens[init.num_prompt_tokens :]
            self._counts[slot] = torch.bincount(output, minlength=self.vocab_size).to(torch.int32)
        self._seqs[init.seq_id] = _Sequence(cfg, init.top_logprobs, init.num_sampled, slot)

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def remove(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and seq.penalty_slot is not None:
            self._free_slots.append(seq.penalty_slot)

    @torch.inference_mode()
    def sample(self, seq_ids: list[int], logits: torch.Tensor) -> SampleResult:
        """logits: [len(seq_ids), vocab], one row per sequence. Records each chosen token in its
        sequence's state."""
        try:
            seqs = [self._seqs[i] for i in seq_ids]
        except KeyError as e:
            raise KeyError(f"sequence {e.args[0]} was never added to the sampler") from None
        if logits.shape != (len(seqs), self.vocab_size):
            raise ValueError(f"logits shape {tuple(logits.shape)}, expected ({len(seqs)}, {self.vocab_size})")
        logits = logits.to(self.device, torch.float32)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.top_logprobs for s in seqs) else None

        logits = self._penalize(seqs, logits)
        all_greedy = all(s.config.greedy for s in seqs)
        tokens = logits.argmax(dim=-1) if all_greedy else self._draw(seqs, logits)

        self._record(seqs, tokens)
        token_ids = tokens.tolist()
        if raw_logprobs is None:
            return SampleResult(token_ids, [], [], [])
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_ids, top_lps = [], []
        n_max = max(s.top_logprobs for s in seqs)
        values, ids = raw_logprobs.topk(n_max, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        for i, s in enumerate(seqs):
            top_ids.extend(ids[i][: s.top_logprobs])
            top_lps.extend(values[i][: s.top_logprobs])
        return SampleResult(token_ids, chosen, top_ids, top_lps)

    @torch.inference_mode()
    def apply_penalties(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The logits after each sequence's repetition/presence/frequency penalties (a new tensor)."""
        return self._penalize([self._seqs[i] for i in seq_ids], logits.to(self.device, torch.float32).clone())

    def _penalize(self, seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.penalty_slot is not None]
        if not rows:
            return logits
        cfgs = [seqs[i].config for i in rows]
        slots = self._tensor([seqs[i].penalty_slot for i in rows], torch.long)
        row_index = self._tensor(rows, torch.long)
        sub = logits.index_select(0, row_index)
        counts = self._counts.index_select(0, slots).to(sub.dtype)
        seen = self._seen.index_select(0, slots)
        # Repetition (transformers' rule): over prompt and output, shrink a logit towards zero.
        rep = self._column([c.repetition_penalty for c in cfgs])
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        # Presence and frequency (OpenAI's rule): over output tokens only.
        sub = sub - self._column([c.frequency_penalty for c in cfgs]) * counts
        sub = sub - self._column([c.presence_penalty for c in cfgs]) * (counts > 0).to(sub.dtype)
        logits = logits.clone()
        logits.index_copy_(0, row_index, sub)
        return logits

    def _draw(self, seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        cfgs = [s.config for s in seqs]
        greedy = self._tensor([c.greedy for c in cfgs], torch.bool)
        # Greedy rows get temperature 1 and no filters: their draw is discarded below.
        temperature = self._column([1.0 if c.greedy else c.temperature for c in cfgs])
        scaled = logits / temperature
        top_k = [c.top_k if not c.greedy and 0 < c.top_k < self.vocab_size else 0 for c in cfgs]
        top_p = [c.top_p if not c.greedy else 1.0 for c in cfgs]
        if any(top_k) or any(p < 1.0 for p in top_p):
            scaled = self._top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        min_p = [0.0 if c.greedy else c.min_p for c in cfgs]
        if any(min_p):
            # Relative to the most likely token, which every filter keeps, so renormalisation after
            # top-k/top-p does not change which tokens survive.
            floor = self._column(min_p) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)

        # Inverse CDF: one uniform per sequence. searchsorted with right=True never lands on a token
        # of probability zero, since the CDF does not rise there.
        cdf = probs.cumsum(dim=-1)
        u = torch.rand(len(seqs), device=self.device, generator=self._generator)
        seeded = [i for i, s in enumerate(seqs) if s.config.seed is not None and not s.config.greedy]
        if seeded:
            # The one loop per sequence: a seeded sequence's uniform comes from its own (seed, n).
            values = [_uniform(draw_seed(seqs[i].config.seed, seqs[i].num_sampled)) for i in seeded]
            u.index_copy_(0, self._tensor(seeded, torch.long), self._tensor(values, u.dtype))
        target = (u * cdf[:, -1]).unsqueeze(1)
        sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)
        # A draw that rounds up to the whole mass (u of 1 - 2^-53 is 1.0 in float32) lands past every
        # token: it belongs to the last token that has any probability, never to one outside the kept set.
        last_kept = self.vocab_size - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
        sampled = torch.minimum(sampled, last_kept)
        if not any(c.greedy for c in cfgs):
            return sampled
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _top_k_top_p(self, scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Sets the logits of tokens outside each row's top-k / top-p set to -inf.

        Sorting a whole vocab row is the expensive part, and the kept set is usually small: the
        CANDIDATES best tokens are used instead whenever they provably contain every row's kept set,
        and the full sort only otherwise. Both give the same set.
        """
        filtered = self._tensor([k > 0 or p < 1.0 for k, p in zip(top_k, top_p, strict=True)], torch.bool)
        k = self._tensor([k or self.vocab_size for k in top_k], torch.long)
        p = self._column(top_p)
        # The top-p mass is measured over the top-k set when there is one, else over the whole row.
        needs_full_lse = any(kk == 0 and pp < 1.0 for kk, pp in zip(top_k, top_p, strict=True))
        full_lse = torch.logsumexp(scaled, dim=-1) if needs_full_lse else scaled.new_zeros(len(top_k))
        kept = None
        if self.vocab_size > CANDIDATES:
            values, order = scaled.topk(CANDIDATES, dim=-1)
            kept, covered = self._keep_sorted(values, k, p, full_lse)
            if not bool((covered | ~filtered).all()):
                kept = None
        if kept is None:
            values, order = scaled.sort(dim=-1, descending=True)
            kept, _ = self._keep_sorted(values, k, p, full_lse)
        out = torch.full_like(scaled, float("-inf")).scatter_(-1, order, kept)
        return torch.where(filtered.unsqueeze(1), out, scaled)

    def _keep_sorted(
        self, values: torch.Tensor, k: torch.Tensor, p: torch.Tensor, full_lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """values: each row's best n logits, descending. Returns them with the dropped ones at -inf, and
        per row whether these n were enough to decide its kept set exactly."""
        n = values.shape[1]
        rank = torch.arange(n, device=self.device)
        values = values.masked_fill(rank >= k[:, None], float("-inf"))
        has_top_k = k < self.vocab_size
        lse = torch.where(has_top_k, torch.logsumexp(values, dim=-1), full_lse)
        probs = torch.exp(values - lse[:, None])
        cum = probs.cumsum(dim=-1)
        # A token stays if the tokens ranked above it sum to less than top_p; the first always stays.
        values = values.masked_fill(cum - probs >= p, float("-inf"))
        covered = (has_top_k & (k <= n)) | (~has_top_k & (cum[:, -1:] >= p).squeeze(1))
        return values, covered

    def _record(self, seqs: list[_Sequence], tokens: torch.Tensor) -> None:
        rows = [i for i, s in enumerate(seqs) if s.penalty_slot is not None]
        if rows:
            slots = self._tensor([seqs[i].penalty_slot for i in rows], torch.long)
            chosen = tokens.index_select(0, self._tensor(rows, torch.long))
            # Slots are distinct, so the pairs are too and plain indexed updates are exact.
            self._counts[slots, chosen] += 1
            self._seen[slots, chosen] = True
        for s in seqs:
            s.num_sampled += 1

    def _take_slot(self) -> int:
        if not self._free_slots:
            old = self._counts.shape[0]
            new = max(8, 2 * old)
            self._counts = torch.cat([self._counts, self._counts.new_zeros(new - old, self.vocab_size)])
            self._seen = torch.cat([self._seen, self._seen.new_zeros(new - old, self.vocab_size)])
            self._free_slots.extend(range(new - 1, old - 1, -1))
        slot = self._free_slots.pop()
        self._counts[slot].zero_()
        self._seen[slot].zero_()
        return slot

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(1)
