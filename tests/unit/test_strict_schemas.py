"""JSON Schemas are strict by default (common/grammar.py strict_schema): no properties or items beyond those
named, at every depth, what a schema sets explicitly kept; vLLM's disable_additional_properties relaxes it
per server and per request; the grammar llguidance compiles from a closed schema refuses an unnamed key. A
forced tool call cut by max_tokens is still a call, finish_reason "length", whole and streamed alike."""

from __future__ import annotations

import functools
import json

import pytest

from common.grammar import strict_schema
from common.pb.tpserve.v1 import generation_pb2 as pb
from router.openai.encoder import Encoder
from router.openai.errors import ApiError
from router.openai.protocol import parse_chat, parse_completion
from router.openai.tool_parsers import ForcedCalls

OBJ = {"type": "object", "properties": {"a": {"type": "string"}}}
CLOSED = OBJ | {"additionalProperties": False}


def test_every_object_that_names_properties_is_closed_at_every_depth():
    schema = {
        "type": "object",
        "properties": {
            "list": {"type": "array", "items": OBJ},
            "pair": {"type": "array", "prefixItems": [OBJ, {"type": "integer"}]},
            "either": {"anyOf": [OBJ, {"type": "null"}], "oneOf": [OBJ]},
            "ref": {"$ref": "#/$defs/X"},
            "free": {"type": "object"},  # names nothing: any object
        },
        "$defs": {"X": OBJ},
        "definitions": {"Y": {"patternProperties": {"^x": {"type": "integer"}}}},
    }
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    p = out["properties"]
    assert p["list"]["items"] == CLOSED
    assert p["pair"]["prefixItems"][0] == CLOSED and p["pair"]["items"] is False  # nothing after the pair
    assert p["either"]["anyOf"] == [CLOSED, {"type": "null"}] and p["either"]["oneOf"] == [CLOSED]
    assert p["ref"] == {"$ref": "#/$defs/X"} and out["$defs"]["X"] == CLOSED
    assert out["definitions"]["Y"]["additionalProperties"] is False
    assert p["free"] == {"type": "object"}
    assert "additionalProperties" not in schema and schema["$defs"]["X"] == OBJ  # the input is untouched
    tuple_items = strict_schema({"type": "array", "items": [OBJ]})
    assert tuple_items == {"type": "array", "items": [CLOSED], "additionalItems": False}


def test_what_a_schema_sets_explicitly_is_kept():
    typed = OBJ | {"additionalProperties": {"type": "integer"}}
    assert strict_schema(typed) == typed
    assert strict_schema(OBJ | {"additionalProperties": True}) == OBJ | {"additionalProperties": True}
    tail = {"prefixItems": [{"type": "string"}], "items": {"type": "integer"}}
    assert strict_schema(tail) == tail
    # unevaluatedProperties alone means additionalProperties (which llguidance implements)...
    assert strict_schema(OBJ | {"unevaluatedProperties": True}) == OBJ | {"additionalProperties": True}
    # ... and beside an allOf it is left for llguidance to judge; the allOf members stay open, since
    # each sees only part of the object.
    composed = {"allOf": [OBJ, {"properties": {"b": {"type": "integer"}}}], "unevaluatedProperties": False}
    assert strict_schema(composed) == composed


@functools.cache
def tokenizer():
    """llguidance's own reading of the tiny model's tokenizer.json (transformers is not needed for it)."""
    from llguidance import LLTokenizer

    from tests.conftest import TINY

    if not (TINY / "tokenizer.json").is_file():
        pytest.skip("models/tiny is not built")
    return LLTokenizer(str(TINY / "tokenizer.json"))


def matcher(schema: dict):
    """Whether the grammar of schema admits a text, token by token as the sampler's mask would."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})

    def accepts(text: str) -> bool:
        m = LLMatcher(tokenizer(), grammar)
        return all(m.try_consume_tokens([t]) == 1 for t in tokenizer().tokenize_str(text))

    return accepts


@pytest.mark.parametrize(
    "structured",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": OBJ}}},
        {"guided_json": OBJ},
        {"guided_json": json.dumps(OBJ)},
        {"structured_outputs": {"json": OBJ}},
    ],
    ids=["response_format", "guided_json", "guided_json_text", "structured_outputs"],
)
def test_request_schemas_are_closed_unless_relaxed_by_server_or_request(structured):
    def schema(strict=True, **body) -> dict:
        req = parse_chat({"messages": [{"role": "user", "content": "x"}], **body}, "r", strict=strict)
        return json.loads(req.generate.sampling.structured_output.json_schema)

    assert schema(**structured) == CLOSED
    assert schema(strict=False, **structured) == OBJ  # --no-disable-additional-properties
    if "structured_outputs" in structured:  # the request's own word wins over the server's
        relax = {"json": OBJ, "disable_additional_properties": False}
        assert schema(structured_outputs=relax) == OBJ
        assert (
            schema(strict=False, structured_outputs=relax | {"disable_additional_properties": True}) == CLOSED
        )
        with pytest.raises(ApiError) as e:
            schema(structured_outputs={"json": OBJ, "disable_additional_properties": "no"})
        assert e.value.param == "structured_outputs.disable_additional_properties"
    # What the grammar admits: with the schema closed, a key it never named cannot start.
    closed, open_ = matcher(schema(**structured)), matcher(schema(strict=False, **structured))
    assert closed('{"a":"x"}') and not closed('{"a":"x","b') and open_('{"a":"x","b":1}')
    completion = parse_completion({"prompt": "x", "guided_json": OBJ}, "r")
    assert json.loads(completion.generate.sampling.structured_output.json_schema) == CLOSED


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now"}}


def forced(tool_choice, strict=True, **body) -> dict:
    req = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER, NO_ARGS],
            "tool_choice": tool_choice,
        }
        | body,
        "r",
        "hermes",
        strict=strict,
    )
    return json.loads(req.generate.sampling.structured_output.json_schema)


def test_forced_call_wrappers_admit_only_their_keys_and_parameters_are_closed():
    schema = forced("required")
    weather, now = schema["items"]["anyOf"]
    for item in (weather, now):
        assert set(item["properties"]) == {"name", "parameters"} and item["additionalProperties"] is False
    assert weather["properties"]["parameters"]["additionalProperties"] is False
    assert now["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    named = forced({"type": "function", "function": {"name": "get_weather"}})
    assert named == WEATHER["function"]["parameters"] | {"additionalProperties": False}
    # Relaxed: the parameters are JSON Schema's again, the wrapper still ours.
    weather, _ = forced("required", strict=False)["items"]["anyOf"]
    assert weather["additionalProperties"] is False
    assert weather["properties"]["parameters"] == WEATHER["function"]["parameters"]
    accepts = matcher(forced("required"))
    assert accepts('[{"name":"get_weather","parameters":{"city":"Lyon","unit":"celsius"}}]')
    assert not accepts('[{"name":"get_weather","parameters":{"city":"Lyon","unit":"celsius","u')
    assert not accepts('[{"name":"now","parameters":{},"d')


CUT = '[{"name":"now","parameters":{}},{"name":"get_weather","parameters":{"city":"Lyon","unit":"cel'


@pytest.mark.parametrize(
    "name, text, content, calls, cut",
    [
        (None, CUT, "", [("now", "{}"), ("get_weather", '{"city":"Lyon","unit":"cel')], True),
        (None, '[{"name":"get_weather","param', "", [("get_weather", "")], True),
        (None, '[{"name":"now","parameters":{}}', "", [("now", "{}")], True),
        (None, '[{"name":"now","parameters":{}}]', "", [("now", "{}")], False),
        (None, '[{"name":"get_wea', '[{"name":"get_wea', [], False),  # no name written: no call to report
        ("get_weather", '{"city":"Oslo"', "", [("get_weather", '{"city":"Oslo"')], True),
    ],
)
def test_a_forced_answer_cut_short_is_the_calls_it_began(name, text, content, calls, cut):
    whole = ForcedCalls(name)
    out = whole.parse(text)
    assert (out.content, [(c.name, c.arguments) for c in out.calls], whole.cut) == (content, calls, cut)
    byte = ForcedCalls(name)
    for ch in text:
        assert byte.feed(ch).calls == []  # a call goes out whole, once the answer ends
    last = byte.finish()
    assert [(c.name, c.arguments) for c in last.calls] == calls and byte.cut == cut


@pytest.mark.parametrize("finish", [pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS])
def test_the_encoder_reports_a_cut_call_with_finish_reason_length_whole_and_streamed(finish):
    req = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "required"}, "r"
    )
    text = CUT if finish == pb.FINISH_REASON_LENGTH else CUT + 'sius"}}]'
    pieces = [text[:20], text[20:50], text[50:]]
    resps = [pb.GenerateResponse(text=p) for p in pieces]
    resps[-1].finish_reason = finish
    new = functools.partial(ForcedCalls, None)
    [choice] = Encoder(req, "m", created=1, tool_parser=new).whole(resps)["choices"]
    stream = Encoder(req, "m", created=1, tool_parser=new)
    chunks = [c["choices"][0] for c in map(stream.chunk, resps) if c is not None]
    streamed = [call for c in chunks for call in c["delta"].get("tool_calls", [])]
    expected = "length" if finish == pb.FINISH_REASON_LENGTH else "tool_calls"
    assert choice["finish_reason"] == chunks[-1]["finish_reason"] == expected
    assert choice["message"]["content"] is None and not any(c["delta"].get("content") for c in chunks)
    whole_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ]
    assert whole_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in streamed]
    assert [c["index"] for c in streamed] == [0, 1] and whole_calls[0] == ("now", "{}")
    cut_args = whole_calls[1][1]
    assert (
        cut_args == '{"city":"Lyon","unit":"cel'
        if finish == pb.FINISH_REASON_LENGTH
        else json.loads(cut_args)
    )
