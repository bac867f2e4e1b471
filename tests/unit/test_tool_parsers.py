"""Tool calls parsed out of model text (router/openai/tool_parsers.py), as vLLM's hermes, llama3_json and
mistral parsers read them; streamed one character at a time, the same calls and content come out as from
the whole text, and nothing that may open a call is ever sent as content."""

from __future__ import annotations

import json

import pytest

from router.openai.tool_parsers import PARSERS, Parsed, held_prefix

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
TIME = {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}


def calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def streamed(name: str, text: str, step: int = 1) -> tuple[Parsed, list[str]]:
    """Fed `step` characters at a time: everything out, and the content pieces as they were sent."""
    parser, out, pieces = PARSERS[name](), Parsed(), []
    for i in range(0, len(text), step):
        got = parser.feed(text[i : i + step])
        pieces.append(got.content)
        out += got
    last = parser.finish()
    pieces.append(last.content)
    out += last
    return out, pieces


CASES = [
    # (parser, model text, content, calls)
    ("hermes", "Hello!", "Hello!", []),
    (
        "hermes",
        f"<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>\n<tool_call>\n{json.dumps(TIME)}\n</tool_call>\n",
        "",
        [WEATHER, TIME],
    ),
    ("hermes", f"Let me check.\n<tool_call>{json.dumps(WEATHER)}</tool_call>", "Let me check.", [WEATHER]),
    ("hermes", f"<tool_call>{json.dumps(WEATHER)}", "", [WEATHER]),  # unterminated at the end: still a call
    ("hermes", "<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok", []),
    ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": WEATHER["arguments"]}), "", [WEATHER]),
    ("llama3_json", f"<|python_tag|>{json.dumps(WEATHER)}; {json.dumps(TIME)}", "", [WEATHER, TIME]),
    ("llama3_json", "The weather is {sunny}.", "The weather is {sunny}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3_json", '{"name": "f", "arguments": {', '{"name": "f", "arguments": {', []),
    ("mistral", f"[TOOL_CALLS] [{json.dumps(WEATHER)}, {json.dumps(TIME)}]", "", [WEATHER, TIME]),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "C"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
        "Sure.",
        [WEATHER, TIME],
    ),
    ("mistral", "No tools [TOOL", "No tools [TOOL", []),
    ("mistral", "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
]


@pytest.mark.parametrize("name, text, content, want", CASES)
def test_whole_and_streamed_answers_agree(name, text, content, want):
    whole = PARSERS[name]().parse(text)
    assert (whole.content, calls(whole)) == (content, [(c["name"], c["arguments"]) for c in want])
    for step in (1, 3, 7):
        out, _ = streamed(name, text, step)
        assert (out.content, calls(out)) == (whole.content, calls(whole))


@pytest.mark.parametrize("name, marker", [("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]")])
def test_text_that_may_open_a_call_is_held_back_and_released_when_it_does_not(name, marker):
    text = f"Hi {marker[:-1]}x done"
    out, pieces = streamed(name, text)
    assert out.content == text and not out.calls
    # While the marker's start was arriving, nothing of it was sent.
    sent = ""
    for piece in pieces:
        sent += piece
        assert not (sent.endswith(marker[:3]) and len(sent) < len(text))
    assert held_prefix("abc <tool", "<tool_call>") == 5 and held_prefix("abc", "<tool_call>") == 0


def test_calls_stream_as_soon_as_each_is_complete():
    parser = PARSERS["hermes"]()
    first = parser.feed(f"<tool_call>{json.dumps(WEATHER)}</tool_call>\n<tool_call>{json.dumps(TIME)[:10]}")
    assert calls(first) == [("get_weather", WEATHER["arguments"])] and first.content == ""
    rest = parser.feed(json.dumps(TIME)[10:] + "</tool_call>")
    assert calls(rest) == [("get_time", TIME["arguments"])]
    ids = {c.id for c in first.calls + rest.calls}
    assert len(ids) == 2 and all(i.startswith("call_") for i in ids)
    mistral = PARSERS["mistral"]().parse(f"[TOOL_CALLS] [{json.dumps(WEATHER)}]")
    assert len(mistral.calls[0].id) == 9 and mistral.calls[0].id.isalnum()  # what Mistral's templates check
    assert PARSERS["mistral"].needs_special_tokens and not PARSERS["hermes"].needs_special_tokens
