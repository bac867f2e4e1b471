"""A reasoning model's think block on rank 0 (common/reasoning.py): each sequence's ThinkTracker follows its
output; once a thinking budget is spent the end tag is forced, one token a step (vLLM's
thinking_token_budget). The grammar processor asks `inside` to wait while the block is open, so a
structured output starts with the content.

A forced token is the only one left: every other logit -inf and its own 0, whatever earlier processors did
(a bias or a bad word cannot keep the block open past its budget).
"""

from __future__ import annotations

import torch

from common.reasoning import INSIDE, ThinkTracker
from shard_worker.sampling.processors import LogitsProcessor, SequenceState

KEY = "think"


def inside(state: SequenceState) -> bool:
    """Whether the sequence is inside its think block (no grammar applies there)."""
    tracker = state.extra.get(KEY)
    return tracker is not None and tracker.phase == INSIDE


def content_ids(state: SequenceState, output_ids: list[int]) -> list[int]:
    """The output tokens after the think block: what a grammar has seen so far."""
    tracker = state.extra.get(KEY)
    if tracker is None or tracker.content_start is None:
        return [] if tracker is not None and tracker.phase == INSIDE else output_ids
    return output_ids[tracker.content_start :]


class ThinkingProcessor(LogitsProcessor):
    def __init__(self, device: torch.device):
        self.device = device

    def wants(self, config):
        return config.reasoning is not None

    def init(self, state, token_ids, num_prompt_tokens):
        state.extra[KEY] = ThinkTracker(state.config.reasoning, token_ids[num_prompt_tokens:])

    def release(self, state):
        state.extra.pop(KEY, None)

    def apply(self, states, rows, logits):
        for row, s in zip(rows.tolist(), states, strict=True):
            forced = s.extra[KEY].forced
            if forced is not None:
                logits[row].fill_(float("-inf"))
                logits[row, forced] = 0.0

    def accept(self, states, tokens):
        for s, token in zip(states, tokens.tolist(), strict=True):
            s.extra[KEY].accept(token)
