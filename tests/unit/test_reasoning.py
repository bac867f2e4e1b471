"""The reasoning parsers (router/reasoning.py): each case's whole split as vLLM's parser gives it, and the
same text streamed cut at every position (and at every pair of positions) giving the same split."""

import random

import pytest

from router.reasoning import (
    ReasoningParser,
    Split,
    reasoning_token_count,
    split,
    starts_in_reasoning,
)

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
    start, end = 7, 8
    assert starts_in_reasoning([1, 2, start], start, end)
    assert starts_in_reasoning([1, start, 5, 6], start, end)
    assert not starts_in_reasoning([1, start, 5, end, 6], start, end)  # enable_thinking false: empty block
    assert not starts_in_reasoning([1, 2, 3], start, end)
    assert not starts_in_reasoning([1, 2, 3], None, None)


def test_reasoning_token_count():
    start, end = 7, 8
    assert reasoning_token_count("qwen3", [1, 2, end, 3], True, start, end) == 3
    assert reasoning_token_count("qwen3", [start, 2, end, 3, 4], False, start, end) == 3
    assert reasoning_token_count("qwen3", [1, 2, 3], False, start, end) == 0
    assert reasoning_token_count("qwen3", [1, 2, 3], True, start, end) == 3
    assert reasoning_token_count("deepseek_r1", [1, end, 3], False, start, end) == 2
    assert reasoning_token_count("deepseek_r1", [], False, start, end) == 0
