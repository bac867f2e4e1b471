"""A reasoning model's output split into its reasoning and its content, chosen by --reasoning-parser as vLLM
names the parsers:

- qwen3: `<think>reasoning</think>content`. Qwen3's templates open the think block in the prompt when thinking
  is on by default (Qwen3-*-Thinking-2507, Qwen3.5) or leave the model to write `<think>` itself (Qwen3's
  hybrid template with enable_thinking): the output starts inside reasoning when the prompt ends inside an
  open block, or when the output begins with `<think>`; otherwise it is all content.
- deepseek_r1: the output always starts inside reasoning (R1's template opens the block), a leading
  `<think>` (R1-0528 writes one) is dropped, and `</think>` ends it.

A parser is incremental: feed(text) returns what can be told apart so far and holds back text that may still
be the start of a tag (a tag split across deltas); finish() settles the rest. The whole answer is the same
parser fed everything (`split`), so a streamed answer and a whole one never disagree. The tags themselves
are in neither part; the raw text is `<think>`? + reasoning + `</think>` + content.

Whether the output starts inside reasoning is read from the prompt's token ids (`starts_in_reasoning`), since
where the template left the block is a fact of the prompt, not of the text the model writes. The same ids
let the router count reasoning tokens (`reasoning_token_count`) and tell the workers where the reasoning ends
(the thinking budget's forced close, the point a grammar starts).

Pure Python, no torch or gRPC: the router's APIs (chat completions, Anthropic's thinking blocks, Responses'
reasoning items) share it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from common.reasoning import ReasoningSpec, ThinkTracker
from router.openai.tool_parsers import held_prefix
from router.validation_error import ValidationError

THINK_START, THINK_END = "<think>", "</think>"
BEFORE, REASONING, CONTENT = "before", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningFormat:
    """A parser's tags and its rule for where the output starts."""

    name: str
    start: str
    end: str
    always_starts_inside: bool  # deepseek_r1: the template always opens the block


FORMATS = {
    "qwen3": ReasoningFormat("qwen3", THINK_START, THINK_END, always_starts_inside=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", THINK_START, THINK_END, always_starts_inside=True),
}
NAMES = tuple(FORMATS)


@dataclass
class Split:
    """What a feed or finish produced: reasoning text and content text (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser:
    """One choice's output, split as it streams. in_reasoning: the prompt left the think block open."""

    def __init__(self, fmt: ReasoningFormat | str, in_reasoning: bool):
        self.format = FORMATS[fmt] if isinstance(fmt, str) else fmt
        # BEFORE: nothing seen yet and the output may still open the block with its first characters.
        self.state = REASONING if in_reasoning or self.format.always_starts_inside else BEFORE
        self._at_start = True  # a start tag is looked for only at the very beginning of the output
        self._buf = ""  # text held back: maybe the start of a tag

    @property
    def reasoning_ended(self) -> bool:
        """Whether the content has started (the think block closed, or there was none)."""
        return self.state == CONTENT

    def feed(self, text: str) -> Split:
        out = Split()
        self._buf += text
        while self._buf:
            if self._at_start and self.state in (BEFORE, REASONING):
                start = self.format.start
                if self._buf.startswith(start):
                    self._buf = self._buf[len(start) :]
                    self.state = REASONING
                elif start.startswith(self._buf):
                    return out  # may still become the start tag
                elif self.state == BEFORE:
                    self.state = CONTENT
                self._at_start = False
                continue
            if self.state == CONTENT:
                out.content += self._buf
                self._buf = ""
                return out
            end = self.format.end
            at = self._buf.find(end)
            if at >= 0:
                out.reasoning += self._buf[:at]
                self._buf = self._buf[at + len(end) :]
                self.state = CONTENT
                continue
            keep = held_prefix(self._buf, end)
            out.reasoning += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            return out
        return out

    def finish(self) -> Split:
        """The text held back, now that no more comes: what it was, in the part it was in."""
        rest, self._buf = self._buf, ""
        if self.state == REASONING:
            # An unfinished start tag at the very start is text like any other.
            return Split(reasoning=rest)
        self.state = CONTENT
        return Split(content=rest)


def split(fmt: ReasoningFormat | str, text: str, in_reasoning: bool) -> Split:
    """A whole output's reasoning and content."""
    parser = ReasoningParser(fmt, in_reasoning)
    out = parser.feed(text)
    out += parser.finish()
    return out


def _last(ids: Sequence[int], tag: Sequence[int]) -> int:
    """Where tag last occurs in ids (-1: nowhere); scanned from the end, where templates put it."""
    n = len(tag)
    if not n:
        return -1
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == tag[0] and tuple(ids[i : i + n]) == tuple(tag):
            return i
    return -1


def starts_in_reasoning(prompt_ids: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside an open think block: its last start tag comes after its last end tag
    (a template that turned thinking off writes an empty block, `<think>\\n\\n</think>`, which is closed)."""
    return _last(prompt_ids, start_ids) > _last(prompt_ids, end_ids)


def reasoning_spec(
    name: str,
    prompt_ids: Sequence[int],
    start_ids: Sequence[int],
    end_ids: Sequence[int],
    budget: int | None = None,
) -> ReasoningSpec:
    """What rank 0 is told of a chat request's think block under parser name."""
    inside = FORMATS[name].always_starts_inside or starts_in_reasoning(prompt_ids, start_ids, end_ids)
    return ReasoningSpec(tuple(start_ids), tuple(end_ids), inside, budget)


class ChoiceReasoning:
    """One choice's output split as it streams: each message's text and token ids in, its reasoning and
    content out, and the reasoning tokens counted as rank 0 counts them (common/reasoning.py).
    include false: the reasoning is dropped (vLLM's include_reasoning), the content is the same."""

    def __init__(self, name: str, spec: ReasoningSpec, include: bool = True):
        self.parser = ReasoningParser(name, spec.starts_inside)
        self.tokens = ThinkTracker(spec)
        self.include = include

    @property
    def reasoning_tokens(self) -> int:
        return self.tokens.reasoning_tokens

    def step(self, text: str, token_ids: Sequence[int], final: bool) -> tuple[str, str]:
        """(reasoning, content) new with this message."""
        for t in token_ids:
            self.tokens.accept(t)
        out = self.parser.feed(text)
        if final:
            out += self.parser.finish()
        return (out.reasoning if self.include else ""), out.content


@functools.lru_cache(maxsize=16)
def _tags(tokenizer, fmt: ReasoningFormat) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """The start and end tags' token ids (one added token each, for the models these parsers serve),
    tokenized once, and whether either is a special token (decoding would drop it from the text)."""
    start, end = tuple(tokenizer.encode_words(fmt.start)), tuple(tokenizer.encode_words(fmt.end))
    return start, end, any(tokenizer.is_special(t) for t in start + end)


def for_request(name: str | None, tokenizer, request, req):
    """A validated request (router/validation.py) with its think block set as rank 0 needs it, and what
    makes each choice's ChoiceReasoning (None without a parser). name: --reasoning-parser; tokenizer:
    router/tokenizer.py's; request: the GenerateRequest. A chat prompt only, as vLLM parses chat answers
    only. A client's own sampling.reasoning is always replaced."""
    budget = request.thinking_token_budget if request.HasField("thinking_token_budget") else None
    spec = None
    if name is not None and len(request.messages):
        fmt = FORMATS[name]
        start_ids, end_ids, special = _tags(tokenizer, fmt)
        spec = reasoning_spec(name, req.prompt_token_ids, start_ids, end_ids, budget)
        if special and not request.HasField("skip_special_tokens"):
            # Tags that are special tokens (Qwen3's are not; some checkpoints' are) must stay in the text
            # the parser reads, as the mistral tool parser's [TOOL_CALLS] does.
            req = dataclasses.replace(req, skip_special_tokens=False)
    elif budget is not None:
        why = "the server's --reasoning-parser" if name is None else "a chat prompt (messages)"
        raise ValidationError("thinking_token_budget", f"thinking_token_budget needs {why}")
    if spec is not None or req.sampling.reasoning is not None:
        req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, reasoning=spec))
    if spec is None:
        return req, lambda: None
    include = request.include_reasoning if request.HasField("include_reasoning") else True
    return req, lambda: ChoiceReasoning(name, spec, include)
