"""The reasoning parsers (router/reasoning.py): each case's whole split as vLLM's parser gives it, and the
same text streamed cut at every position (and at every pair of positions) giving the same split."""

import dataclasses
import random

import pytest
from tokenizers import AddedToken

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.reasoning import AFTER, INSIDE, ReasoningSpec, ThinkTracker
from common.sampling import SamplingConfig
from router.reasoning import (
    ChoiceReasoning,
    ReasoningParser,
    Split,
    for_request,
    split,
    starts_in_reasoning,
)
from router.tokenizer import Tokenizer
from router.validation import ValidatedRequest
from router.validation_error import ValidationError

# (parser, the prompt left the block open, output text, reasoning, content)
CASES = [
    # Qwen3, the prompt opened the block (Qwen3-Thinking-2507, a template given enable_thinking).
    ("qwen3", True, "let me see</think>\n\nThe answer is 4.", "let me see", "\n\nThe answer is 4."),
    ("qwen3", True, "cut by max_tokens before the end", "cut by max_tokens before the end", ""),
    ("qwen3", True, "</think>", "", ""),
    ("qwen3", True, "a < b </thinking> </think>x</think>", "a < b </thinking> ", "x</think>"),
    ("qwen3", True, "<think>opened twice</think>ok", "opened twice", "ok"),
    # Qwen3, the prompt did not: the model may open it itself, as the first thing it writes.
    ("qwen3", False, "<think>\nhmm\n</think>\n\nHi!", "\nhmm\n", "\n\nHi!"),
    ("qwen3", False, "Hi, no thinking here.", "", "Hi, no thinking here."),
    ("qwen3", False, "Text then <think>not reasoning</think>", "", "Text then <think>not reasoning</think>"),
    ("qwen3", False, "<thin", "", "<thin"),
    ("qwen3", False, "<think>never closed", "never closed", ""),
    ("qwen3", False, "", "", ""),
    # DeepSeek-R1: always inside; R1-0528 writes <think> again.
    ("deepseek_r1", False, "step 1, step 2</think>Done.", "step 1, step 2", "Done."),
    ("deepseek_r1", False, "<think>step</think>Done.", "step", "Done."),
    ("deepseek_r1", True, "no end, all reasoning <", "no end, all reasoning <", ""),
    ("deepseek_r1", False, "</thin", "</thin", ""),
    ("deepseek_r1", False, "<thi", "<thi", ""),
]


@pytest.mark.parametrize("name,opened,text,reasoning,content", CASES)
def test_whole_split(name, opened, text, reasoning, content):
    assert split(name, text, opened) == Split(reasoning, content)


def _streamed(name: str, opened: bool, pieces: list[str]) -> Split:
    parser = ReasoningParser(name, opened)
    out = Split()
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    return out


@pytest.mark.parametrize("name,opened,text,reasoning,content", CASES)
def test_every_cut_streams_the_same_split(name, opened, text, reasoning, content):
    for i in range(len(text) + 1):
        assert _streamed(name, opened, [text[:i], text[i:]]) == Split(reasoning, content), i
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _streamed(name, opened, [text[:i], text[i:j], text[j:]]) == Split(reasoning, content)
    # Character by character, and random chunkings.
    assert _streamed(name, opened, list(text)) == Split(reasoning, content)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _streamed(name, opened, pieces) == Split(reasoning, content)


def test_nothing_held_back_that_cannot_be_a_tag():
    # A streamed delta says everything it can: only a possible tag prefix waits.
    parser = ReasoningParser("qwen3", True)
    assert parser.feed("abc") == Split("abc", "")
    assert parser.feed("de</th") == Split("de", "")
    assert parser.feed("ink>xy") == Split("", "xy")
    assert parser.reasoning_ended
    assert parser.feed("<") == Split("", "<")


def test_prompt_state_from_token_ids():
    start, end = (7,), (8,)
    assert starts_in_reasoning([1, 2, 7], start, end)
    assert starts_in_reasoning([1, 7, 5, 6], start, end)
    assert not starts_in_reasoning([1, 7, 5, 8, 6], start, end)  # enable_thinking false: an empty block
    assert not starts_in_reasoning([1, 2, 3], start, end)
    # Tags of several tokens.
    assert starts_in_reasoning([9, 7, 7, 1, 8, 7, 7, 2], (7, 7), (8,))
    assert not starts_in_reasoning([9, 7, 7, 1, 8, 7, 2], (7, 7), (8,))


def _spec(inside: bool, budget=None, start=(7,), end=(8,)) -> ReasoningSpec:
    return ReasoningSpec(start, end, inside, budget)


def test_think_tracker_counts_reasoning_tokens_without_tags():
    assert ThinkTracker(_spec(True), [1, 2, 8, 3]).reasoning_tokens == 2
    t = ThinkTracker(_spec(False), [7, 2, 8, 3, 4])
    assert (t.reasoning_tokens, t.phase, t.content_start) == (1, AFTER, 3)
    t = ThinkTracker(_spec(False), [1, 2, 3])
    assert (t.reasoning_tokens, t.phase, t.content_start) == (0, AFTER, 0)
    t = ThinkTracker(_spec(True), [1, 2, 3])
    assert (t.reasoning_tokens, t.phase, t.content_start) == (3, INSIDE, None)
    # Opened in the prompt and again by the model (DeepSeek-R1-0528): the tag is not reasoning.
    assert ThinkTracker(_spec(True), [7, 1, 2, 8, 3]).reasoning_tokens == 2
    assert ThinkTracker(_spec(True), [1, 7, 2, 8, 3]).reasoning_tokens == 3
    t = ThinkTracker(_spec(False, start=(7, 7), end=(8, 8)), [7, 7, 1, 8, 1, 8, 8, 5])
    assert (t.reasoning_tokens, t.phase, t.content_start) == (3, AFTER, 7)


def test_budget_forces_the_end_tag_after_n_reasoning_tokens():
    for budget in (0, 1, 3):
        t = ThinkTracker(_spec(True, budget, end=(8, 9)))
        out = []
        while t.phase == INSIDE:
            token = t.forced if t.forced is not None else 5
            t.accept(token)
            out.append(token)
        assert out == [5] * budget + [8, 9]
        assert t.reasoning_tokens == budget
    # Opened by the model itself: the start tag is not counted.
    t = ThinkTracker(_spec(False, 2), [7, 5])
    assert t.forced is None
    t.accept(5)
    assert t.forced == 8
    # No block, or closed: nothing forced.
    assert ThinkTracker(_spec(False, 0), [5]).forced is None
    assert ThinkTracker(_spec(True, 5), [8]).forced is None


def test_choice_reasoning_splits_text_and_counts_tokens():
    choice = ChoiceReasoning("qwen3", _spec(True))
    assert choice.step("thought", [1], False) == ("thought", "")
    assert choice.step("</think>answer", [8, 2], True) == ("", "answer")
    assert choice.reasoning_tokens == 1
    hidden = ChoiceReasoning("qwen3", _spec(True), include=False)
    assert hidden.step("thought</think>answer", [1, 8, 2], True) == ("", "answer")


def _validated(prompt_ids) -> ValidatedRequest:
    return ValidatedRequest("", tuple(prompt_ids), None, 16, SamplingConfig(), (), (), False, 0)


@pytest.mark.parametrize("special", [False, True])
def test_a_chat_request_gets_its_think_block_and_keeps_special_tags_in_its_text(tiny_model, special):
    tok = Tokenizer.from_pretrained(str(tiny_model))
    tok.hf.add_tokens([AddedToken("<think>", special=special), AddedToken("</think>", special=special)])
    start, end = tok.hf.convert_tokens_to_ids(["<think>", "</think>"])
    chat = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], thinking_token_budget=3)
    req, choice = for_request("qwen3", tok, chat, _validated([5, 6, start]))
    assert req.sampling.reasoning == ReasoningSpec((start,), (end,), starts_inside=True, budget=3)
    assert req.skip_special_tokens is not special  # special tags must stay in the text the parser reads
    assert choice().step("a</think>b", [9, end, 10], True) == ("a", "b")
    closed, _ = for_request("qwen3", tok, chat, _validated([5, start, end]))
    assert not closed.sampling.reasoning.starts_inside
    # Without a parser (or for a text prompt) a budget is refused, and a client's own control is dropped.
    with pytest.raises(ValidationError, match="--reasoning-parser"):
        for_request(None, tok, chat, _validated([5]))
    with pytest.raises(ValidationError, match="chat prompt"):
        for_request("qwen3", tok, pb.GenerateRequest(text="hi", thinking_token_budget=1), _validated([5]))
    theirs = dataclasses.replace(
        _validated([5]), sampling=SamplingConfig(reasoning=ReasoningSpec((1,), (2,), True))
    )
    plain, none = for_request("qwen3", tok, pb.GenerateRequest(text="hi"), theirs)
    assert plain.sampling.reasoning is None and none() is None
