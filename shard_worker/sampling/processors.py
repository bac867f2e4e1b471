"""Logits processors: per-sequence changes to the logits before a token is chosen (rank 0 only).

The sampler runs them in order over each step's logits: penalties, logit_bias, min_tokens, bad words,
and later a grammar's allowed-token mask. A processor serves only the sequences that need it (`wants`),
and works on all of them at once: `apply` gets the rows of the step's logits that belong to its sequences
and edits them in place, `accept` hears the token each of them was given. Greedy decoding is an argmax
after them, so they apply to greedy sequences too.

A sequence's state lives in its SequenceState (one object per sequence, which the worker keeps with the
sequence's block table); a processor keeps only what it shares across sequences (the penalty tables).
Every processor builds its state from the sequence's tokens so far (`init`), so a sequence rebuilt
after a preemption, a lost rank or a resume continues exactly where it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.sampling import SamplingConfig
from shard_worker.sampling.draw import column as _column


@dataclass
class SequenceState:
    """Everything rank 0 keeps to sample one sequence."""

    config: SamplingConfig
    top_logprobs: int
    num_sampled: int  # output tokens so far: the next draw is output position num_sampled
    output_ids: list[int]  # for processors that look at the output's tail (bad words)
    stop_token_ids: frozenset[int] = frozenset()
    processors: tuple = ()  # the processors this sequence uses, in the sampler's order
    penalty_slot: int | None = None  # Penalties: its row in the count tables
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # LogitBias: (ids, values) on the device
    extra: dict = field(default_factory=dict)  # state of processors added later (a grammar matcher)


class LogitsProcessor:
    """One kind of change to the logits, over every sequence that needs it."""

    def wants(self, init_config: SamplingConfig) -> bool:
        raise NotImplementedError

    def init(self, state: SequenceState, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Builds the sequence's state from its tokens so far (prompt, then output)."""

    def release(self, state: SequenceState) -> None:
        """The sequence is gone: give back what it held."""

    def apply(self, states: list[SequenceState], rows: torch.Tensor, logits: torch.Tensor) -> None:
        """Edits logits[rows[i]] for states[i], in place."""
        raise NotImplementedError

    def idle(self, state: SequenceState) -> bool:
        """The sequence uses this processor but not at this token (a grammar inside a think block)."""
        return False

    def accept(self, states: list[SequenceState], tokens: torch.Tensor) -> None:
        """tokens[i] was chosen for states[i] (before num_sampled counts it)."""


class Penalties(LogitsProcessor):
    """Repetition (transformers' rule, over prompt and output) and presence/frequency (OpenAI's rule,
    over the output). Output-token counts and a seen mask live in tables with a row per sequence."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free_slots: list[int] = []

    def wants(self, config):
        return config.has_penalties

    def init(self, state, token_ids, num_prompt_tokens):
        slot = state.penalty_slot = self._take_slot()
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        self._seen[slot, tokens] = True
        output = tokens[num_prompt_tokens:]
        self._counts[slot] = torch.bincount(output, minlength=self.vocab_size).to(torch.int32)

    def release(self, state):
        self._free_slots.append(state.penalty_slot)
        state.penalty_slot = None

    def apply(self, states, rows, logits):
        cfgs = [s.config for s in states]
        slots = _tensor([s.penalty_slot for s in states], torch.long, self.device)
        sub = logits.index_select(0, rows)
        counts = self._counts.index_select(0, slots).to(sub.dtype)
        seen = self._seen.index_select(0, slots)
        rep = _column([c.repetition_penalty for c in cfgs], self.device)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - _column([c.frequency_penalty for c in cfgs], self.device) * counts
        sub = sub - _column([c.presence_penalty for c in cfgs], self.device) * (counts > 0).to(sub.dtype)
        logits.index_copy_(0, rows, sub)

    def accept(self, states, tokens):
        slots = _tensor([s.penalty_slot for s in states], torch.long, self.device)
        # Slots are distinct, so the pairs are too and plain indexed updates are exact.
        self._counts[slots, tokens] += 1
        self._seen[slots, tokens] = True

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


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a fixed value added to chosen tokens' logits, every step."""

    def __init__(self, device: torch.device):
        self.device = device

    def wants(self, config):
        return bool(config.logit_bias)

    def init(self, state, token_ids, num_prompt_tokens):
        ids, values = zip(*state.config.logit_bias, strict=True)
        state.bias = (_tensor(ids, torch.long, self.device), _tensor(values, torch.float32, self.device))

    def apply(self, states, rows, logits):
        # Per (row, biased id) pair, its row: built in Python (a handful of rows), not repeat_interleave.
        row_index = _tensor(
            [r for r, s in zip(rows.tolist(), states, strict=True) for _ in range(len(s.bias[0]))],
            torch.long,
            self.device,
        )
        ids = torch.cat([s.bias[0] for s in states])
        values = torch.cat([s.bias[1] for s in states]).to(logits.dtype)
        logits.index_put_((row_index, ids), values, accumulate=True)


class MinTokens(LogitsProcessor):
    """vLLM's min_tokens: the model's EOS ids and the request's stop_token_ids cannot be chosen before
    min_tokens tokens have been generated."""

    def __init__(self, eos_token_ids, device: torch.device):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device

    def wants(self, config):
        return config.min_tokens > 0

    def apply(self, states, rows, logits):
        row_index, ids = [], []
        for row, s in zip(rows.tolist(), states, strict=True):
            if s.num_sampled < s.config.min_tokens:
                banned = self.eos_token_ids | s.stop_token_ids
                row_index += [row] * len(banned)
                ids += banned
        if ids:
            index = (_tensor(row_index, torch.long, self.device), _tensor(ids, torch.long, self.device))
            logits.index_put_(index, _tensor([float("-inf")], logits.dtype, self.device))


class BadWords(LogitsProcessor):
    """vLLM's bad_words: whenever the output ends with all but the last id of a banned sequence, that
    last id cannot be chosen (a one-id sequence is banned always)."""

    def __init__(self, device: torch.device):
        self.device = device

    def wants(self, config):
        return bool(config.bad_words_token_ids)

    def apply(self, states, rows, logits):
        row_index, ids = [], []
        for row, s in zip(rows.tolist(), states, strict=True):
            out = s.output_ids
            for word in s.config.bad_words_token_ids:
                prefix = len(word) - 1
                if prefix == 0 or (len(out) >= prefix and out[-prefix:] == list(word[:-1])):
                    row_index.append(row)
                    ids.append(word[-1])
        if ids:
            index = (_tensor(row_index, torch.long, self.device), _tensor(ids, torch.long, self.device))
            logits.index_put_(index, _tensor([float("-inf")], logits.dtype, self.device))


def _tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=dtype, device=device)
