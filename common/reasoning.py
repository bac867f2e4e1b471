"""A reasoning model's think block seen as token ids: where it opens and closes in a sequence's output. The
router fills a ReasoningSpec from --reasoning-parser and the prompt (router/reasoning.py splits the text);
rank 0 follows the spec token by token to close the block when a thinking budget is spent and to start a
grammar only once the block has closed (shard_worker/sampling/thinking.py). Both read the output with the
same ThinkTracker, so the usage the router reports and the budget the worker enforces count alike.

Pure Python, no torch: a sequence rebuilt from its tokens replays them into a fresh tracker.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BEFORE, INSIDE, AFTER = "before", "inside", "after"


@dataclass(frozen=True)
class ReasoningSpec:
    """What rank 0 needs of one sequence's think block."""

    start_ids: tuple[int, ...]  # the start tag's tokens (`<think>`)
    end_ids: tuple[int, ...]  # the end tag's tokens (`</think>`)
    starts_inside: bool  # the prompt (or the parser's rule) opened the block: the output starts inside it
    budget: int | None = None  # thinking_token_budget: reasoning tokens before the end tag is forced

    def to_proto(self):
        from common.pb.tpserve.v1 import generation_pb2 as pb

        msg = pb.ReasoningControl(
            start_token_ids=self.start_ids, end_token_ids=self.end_ids, starts_inside=self.starts_inside
        )
        if self.budget is not None:
            msg.thinking_token_budget = self.budget
        return msg

    @classmethod
    def from_proto(cls, msg) -> ReasoningSpec | None:
        if not msg.end_token_ids:
            return None
        budget = msg.thinking_token_budget if msg.HasField("thinking_token_budget") else None
        return cls(tuple(msg.start_token_ids), tuple(msg.end_token_ids), msg.starts_inside, budget)


class ThinkTracker:
    """The output's place relative to the think block, one token at a time: BEFORE (nothing yet, and the
    output may still open the block with the start tag), INSIDE, AFTER (the block closed, or never opened).
    """

    def __init__(self, spec: ReasoningSpec, output_ids: Iterable[int] = ()):
        self.spec = spec
        self.phase = INSIDE if spec.starts_inside else BEFORE
        self.content_start: int | None = None  # AFTER: the output index where the content begins
        self._seen = 0  # output tokens accepted
        self._head: list[int] = []  # BEFORE: the output so far (a proper prefix of the start tag)
        self._inside = 0  # tokens accepted inside the block, the end tag's included
        self._tail: list[int] = []  # INSIDE: the last tokens, to find the end tag
        for t in output_ids:
            self.accept(t)

    @property
    def reasoning_tokens(self) -> int:
        """Tokens inside the block, its tags excluded (usage's reasoning_tokens)."""
        return self._inside - len(self.spec.end_ids) if self.phase == AFTER and self._inside else self._inside

    @property
    def forced(self) -> int | None:
        """The token that must come next: the end tag's next one once the budget is spent, else None."""
        budget = self.spec.budget
        if self.phase != INSIDE or budget is None or self._inside < budget:
            return None
        return self.spec.end_ids[min(self._inside - budget, len(self.spec.end_ids) - 1)]

    def accept(self, token: int) -> None:
        self._seen += 1
        spec = self.spec
        if self.phase == BEFORE:
            self._head.append(token)
            if tuple(self._head) == spec.start_ids:
                self.phase = INSIDE
            elif tuple(self._head) != spec.start_ids[: len(self._head)]:
                self.phase, self.content_start = AFTER, 0  # no block: it is all content
        elif self.phase == INSIDE:
            self._inside += 1
            if self._seen <= len(spec.start_ids):
                self._head.append(token)
                if self._seen == len(spec.start_ids) and tuple(self._head) == spec.start_ids:
                    # A start tag written again where the template already opened the block (DeepSeek-R1-0528
                    # does): a tag, not reasoning, as the text parser drops it.
                    self._inside -= len(spec.start_ids)
            self._tail = (self._tail + [token])[-len(spec.end_ids) :]
            if tuple(self._tail) == spec.end_ids:
                self.phase, self.content_start = AFTER, self._seen
