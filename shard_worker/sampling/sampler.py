"""Chooses the next tokens of each sequence in a step from its logits (rank 0 only).

A sequence may be sampled at several positions in one step: its last query positions, when the tokens
after the first are proposals to verify (speculative decoding). Its positions are sampled in order, and
it goes on to the next one only while the token chosen equals the proposal there: the tokens it gets
are the accepted proposals and one more. Each depth is one batched pass over the sequences still going,
so every processor sees the state after the tokens accepted so far, exactly as one token per step would.

Per pass: the logits processors (processors.py) in order, then argmax for greedy rows, or a draw. A
draft model's proposal for an unseeded sampled sequence is judged by the rejection rule instead, which
needs the draft's distribution (speculative.py says which rule applies when, and why each is exact).
Randomness: a token is drawn by inverse CDF from one uniform number per row (the CDF runs over the vocab
in id order, row by row, so a row's result does not depend on the others). Unseeded sequences take their
uniforms from one shared generator. A seeded sequence's uniform for output position i is a hash of
(seed, i) computed in Python: it does not depend on what else is in the batch, on the device, or on
whether proposals were verified, and a sequence rebuilt with num_sampled=k continues exactly where it
left off without replaying k draws.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shard_worker.attention import cpu_ops
from shard_worker.sampling.draw import greedy_or_draw, probabilities
from shard_worker.sampling.grammar import GrammarCompiler, GrammarProcessor
from shard_worker.sampling.processors import (
    BadWords,
    LogitBias,
    MinTokens,
    Penalties,
    SequenceState,
)
from shard_worker.sampling.speculative import rejection_sample
from shard_worker.sampling.thinking import ThinkingProcessor
from shard_worker.step import SequenceInit


class SampleResult(NamedTuple):
    token_counts: list[int]  # per sequence, in the order asked: how many tokens it got
    token_ids: list[int]  # those tokens, concatenated
    logprobs: list[float]  # per token, the raw log-probability; empty when no sequence asked
    top_token_ids: list[int]  # per token of a sequence that asked, its top_logprobs best ids
    top_logprobs: list[float]


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids=(),
        grammars: GrammarCompiler | None = None,
    ):
        """grammars: compiles structured outputs' grammars (None: a sequence with one is refused)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # In the order they apply: the grammar's mask last, so that nothing after it lets back a token it
        # forbids.
        self.processors = [
            Penalties(vocab_size, self.device),
            LogitBias(self.device),
            MinTokens(eos_token_ids, self.device),
            BadWords(self.device),
            # After the others, so a spent thinking budget's end tag wins over them; before the grammar,
            # which waits for the block to close.
            ThinkingProcessor(self.device),
        ]
        self.grammar = GrammarProcessor(grammars, self.device) if grammars is not None else None
        if self.grammar is not None:
            self.processors.append(self.grammar)
        # Shared by unseeded sequences; seeded from the OS, since they promise no reproducibility.
        self._generator = torch.Generator(self.device)
        self._generator.seed()

    def new_state(self, init: SequenceInit) -> SequenceState:
        """A sequence's sampling state, built from its tokens so far (a rebuild continues exactly)."""
        state = SequenceState(
            config=init.sampling,
            top_logprobs=init.top_logprobs,
            num_sampled=init.num_sampled,
            output_ids=list(init.token_ids[init.num_prompt_tokens :]),
            stop_token_ids=frozenset(init.stop_token_ids),
        )
        state.processors = tuple(p for p in self.processors if p.wants(init.sampling))
        if init.sampling.structured is not None and self.grammar is None:
            raise ValueError("this worker has no grammar compiler for sampling.structured_output")
        for p in state.processors:
            p.init(state, init.token_ids, init.num_prompt_tokens)
        return state

    def release(self, state: SequenceState) -> None:
        for p in state.processors:
            p.release(state)

    def grammar_ready(self, state: SequenceState, timeout: float = 0.0) -> bool:
        """Whether the sequence can be sampled: True unless its grammar is still compiling (waiting at most
        timeout seconds). Raises GrammarError (a ValueError) when it cannot be compiled."""
        return (
            self.grammar is None or self.grammar not in state.processors or self.grammar.ready(state, timeout)
        )

    def prepare(self, states: list[SequenceState]) -> None:
        """The step's sampled sequences, before its forward: work that needs no logits starts now (the
        grammar masks are filled on the host while the device runs the model)."""
        if self.grammar is not None:
            self.grammar.prepare(states)

    @torch.inference_mode()
    def sample(
        self,
        states: list[SequenceState],
        counts: list[int],
        proposals: list[list[int]],
        logits: torch.Tensor,
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> SampleResult:
        """logits: [sum(counts), vocab], counts[i] consecutive rows for states[i] (its last positions in
        order); proposals[i]: the counts[i] - 1 tokens being verified after its first position;
        draft_probs[i]: None, or the [counts[i] - 1, vocab] distributions a draft model drew them from
        (then judged by the rejection rule)."""
        if logits.shape != (sum(counts), self.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)}, expected ({sum(counts)}, {self.vocab_size})"
            )
        logits = logits.to(self.device, torch.float32)
        starts = [0] * len(counts)
        for i in range(1, len(counts)):
            starts[i] = starts[i - 1] + counts[i - 1]
        chosen: list[list[int]] = [[] for _ in states]
        want_logprobs = any(s.top_logprobs for s in states)
        lp: list[list[tuple]] = [[] for _ in states]
        active, depth = list(range(len(states))), 0
        while active:
            rows = [starts[i] + depth for i in active]
            if len(rows) == logits.shape[0]:
                sub = logits  # the one-token step: every row, in order
            else:
                sub = logits.index_select(0, torch.tensor(rows, device=self.device))
            verify = [
                (k, draft_probs[i][depth], proposals[i][depth])
                for k, i in enumerate(active)
                if draft_probs is not None and draft_probs[i] is not None and depth < counts[i] - 1
            ]
            tokens = self._sample_rows([states[i] for i in active], sub, want_logprobs, verify)
            token_list = tokens.ids.tolist()
            for k, i in enumerate(active):
                chosen[i].append(token_list[k])
                if want_logprobs:
                    lp[i].append(tokens.logprob_row(k))
            depth += 1
            active = [
                i
                for k, i in enumerate(active)
                if depth < counts[i] and token_list[k] == proposals[i][depth - 1]
            ]
        return self._result(states, chosen, lp, want_logprobs)

    def _sample_rows(self, states: list[SequenceState], logits: torch.Tensor, want_logprobs: bool, verify=()):
        """One token per row (row i for states[i]); records it in the states. verify: (row, q, proposal)
        for the rows whose token is a draft model's proposal judged by the rejection rule."""
        raw = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        edited = None
        # Decided once per pass: a processor that shaped a row's logits hears the token chosen there (the
        # grammar must not hear the end tag that closes a think block, though it is active right after).
        members_of = {
            p: [i for i, s in enumerate(states) if p in s.processors and not p.idle(s)]
            for p in self.processors
        }
        for p in self.processors:
            members = members_of[p]
            if members:
                if edited is None:
                    edited = logits.clone()  # the raw logits stay for the logprobs
                p.apply([states[i] for i in members], torch.tensor(members, device=self.device), edited)
        edited = logits if edited is None else edited
        if all(s.config.greedy for s in states):
            # The draw is the only work this skips. On CPU a vectorised argmax: torch's compares one
            # element at a time (0.5 ms for 8 rows of a 49k vocabulary).
            tokens = cpu_ops.argmax(edited)
            if tokens is None:
                tokens = edited.argmax(dim=-1)
        else:
            tokens = greedy_or_draw(states, edited, self._generator)
        if verify:
            at = torch.tensor([k for k, _, _ in verify], device=self.device)
            p = probabilities([states[k].config for k, _, _ in verify], edited.index_select(0, at))
            q = torch.stack([q for _, q, _ in verify]).to(p)
            d = torch.tensor([d for _, _, d in verify], device=self.device)
            tokens = tokens.index_copy(0, at, rejection_sample(p, q, d, self._generator))
        for p in self.processors:
            members = members_of[p]
            if members:
                p.accept([states[i] for i in members], tokens[torch.tensor(members, device=self.device)])
        for s, t in zip(states, tokens.tolist(), strict=True):
            s.num_sampled += 1
            s.output_ids.append(t)
        return _Rows(tokens, raw, states)

    @staticmethod
    def _result(states, chosen, lp, want_logprobs) -> SampleResult:
        counts = [len(c) for c in chosen]
        ids = [t for c in chosen for t in c]
        if not want_logprobs:
            return SampleResult(counts, ids, [], [], [])
        logprobs, top_ids, top_lps = [], [], []
        for s, rows in zip(states, lp, strict=True):
            for chosen_lp, ids_k, lps_k in rows:
                logprobs.append(chosen_lp)
                top_ids.extend(ids_k[: s.top_logprobs])
                top_lps.extend(lps_k[: s.top_logprobs])
        return SampleResult(counts, ids, logprobs, top_ids, top_lps)


class _Rows:
    """One pass's tokens and, when asked, the raw logprobs of each row."""

    def __init__(self, ids: torch.Tensor, raw: torch.Tensor | None, states: list[SequenceState]):
        self.ids = ids
        self._chosen = self._top_ids = self._top_lps = None
        if raw is not None:
            self._chosen = raw.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
            n = max(s.top_logprobs for s in states)
            if n:
                values, top = raw.topk(n, dim=-1)
                self._top_ids, self._top_lps = top.tolist(), values.tolist()

    def logprob_row(self, k: int) -> tuple[float, list[int], list[float]]:
        if self._top_ids is None:
            return self._chosen[k], [], []
        return self._chosen[k], self._top_ids[k], self._top_lps[k]
