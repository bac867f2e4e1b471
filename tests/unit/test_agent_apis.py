"""The Anthropic Messages and OpenAI Responses adapters without servers: bodies -> the chat body and the one
internal request (router/anthropic/protocol.py, router/openai/responses.py), the chat encoder's chunks ->
each API's events (router/anthropic/encoder.py, router/openai/responses_output.py), read back by each vendor's
own SDK accumulator and compared with the whole answer; the response store's bound; x-api-key and the
error shapes through the HTTP server over a scripted Frontend."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.anthropic import encoder as anth
from router.anthropic.protocol import parse_count_tokens, parse_messages, to_chat
from router.auth import ApiKeys
from router.openai.encoder import Encoder
from router.openai.errors import ApiError
from router.openai.protocol import parse_chat
from router.openai.responses import parse_responses
from router.openai.responses_output import ResponseStream, Said, response
from router.openai.responses_server import ResponseStore, Stored
from router.openai.tool_parsers import HermesParser
from router.stop_strings import StopStringMatcher
from tests.unit.test_openai_api import serve
from tests.unit.test_openai_server import Frontend, scripted

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Hermes(HermesParser):
    """hermes with call ids numbered from 0, so two parsers of the same text agree."""

    def _new_id(self) -> str:
        return f"call_{self.num_calls}"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# ---- Anthropic: bodies ----


def test_a_messages_body_is_the_chat_body_that_asks_the_same():
    body = {
        "model": "m",
        "max_tokens": 30,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "18C"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "tools": [{"name": "get_weather", "description": "now", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\n"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "metadata": {"user_id": "u"},
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        # The tool's result first, then the user's own words, as Anthropic orders them.
        {"role": "tool", "tool_call_id": "t1", "content": "18C", "name": "get_weather"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "description": "now"}}
    ]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["stop"]) == ("required", False, ["\n\n"])
    req = parse_messages(body, "r1", tool_parser="hermes")
    g = req.generate
    assert (g.max_new_tokens, g.sampling.top_k, round(g.sampling.top_p, 3), list(g.stop)) == (
        30,
        40,
        0.9,
        ["\n\n"],
    )
    assert g.sampling.structured_output.json_schema  # "any": the call is made by its grammar
    assert req.tool_choice.mode == "required" and not req.tool_choice.parallel
    assert [m.role for m in g.messages] == ["system", "user", "assistant", "tool", "user"]


def test_tool_choice_forms_and_prefill():
    base = {"max_tokens": 5, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    hi = [{"role": "user", "content": "hi"}]
    for choice, chat_choice in [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ]:
        assert to_chat(base | {"messages": hi, "tool_choice": choice})["tool_choice"] == chat_choice
    # A last assistant message is continued (Anthropic's prefill).
    chat = to_chat({"max_tokens": 5, "messages": [*hi, {"role": "assistant", "content": "Sure:"}]})
    assert chat["continue_final_message"] and chat["add_generation_prompt"] is False
    # What Claude Code sends beyond the spec: its billing header block (dropped: a per-request hash would
    # defeat the prefix cache), context turns as "ctx" or "msg", system turns among the messages.
    claude_code = {
        "max_tokens": 5,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc=1"},
            {"type": "text", "text": "S"},
        ],
        "messages": [{"role": "ctx", "content": "c"}, {"role": "system", "content": "T"}, *hi],
    }
    assert to_chat(claude_code)["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "S"}]},
        {"role": "user", "content": "c"},
        {"role": "system", "content": "T"},
        {"role": "user", "content": "hi"},
    ]
    # count_tokens: the same conversation, no max_tokens needed.
    counted = parse_count_tokens({"model": "m", "system": "s", "messages": hi})
    assert [(m.role, m.content) for m in counted.messages] == [("system", "s"), ("user", "hi")]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens", "max_tokens: Field required"),
        ({"max_tokens": 5, "messages": []}, "messages", "non-empty"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "Extra inputs"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].source",
            '"type": "base64"',
        ),
        (
            {
                "max_tokens": 5,
                "system": [{"type": "image", "source": {}}],
                "messages": [{"role": "user", "content": "x"}],
            },
            "system[0].type",
            "images: in user turns only",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
            "tools[0].input_schema",
            "JSON Schema object is required",
        ),
        (
            # A chat-side check, renamed to the field this API has.
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
            "tool_choice",
            'tool_choice "any" needs tools',
        ),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "max_tokens"),
        (
            {"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].role",
            '"user" or "assistant"',
        ),
    ],
)
def test_bad_messages_bodies(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_messages(body, "r", tool_parser="hermes")
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert anth.error_body(e.value) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": e.value.message},
    }


# ---- Anthropic: the stream ----


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _responses(texts: list[str], reason=pb.FINISH_REASON_EOS) -> list[pb.GenerateResponse]:
    out = [pb.GenerateResponse(text=t, token_ids=[1]) for t in texts]
    out[-1].finish_reason = reason
    if reason == pb.FINISH_REASON_STOP:
        out[-1].stop_string = "\n"
    out[-1].usage.CopyFrom(pb.Usage(prompt_tokens=7, completion_tokens=5))
    return out


def _chat_request(**extra):
    return parse_chat({"messages": [{"role": "user", "content": "x"}]} | extra, "r1", tool_parser="hermes")


@pytest.mark.parametrize(
    "text, reason, stop_reason",
    [
        ("Hello there, friend.", pb.FINISH_REASON_EOS, "end_turn"),
        ("Cut short", pb.FINISH_REASON_LENGTH, "max_tokens"),
        ("Before the stop", pb.FINISH_REASON_STOP, "stop_sequence"),
        ("I will check. " + CALL, pb.FINISH_REASON_EOS, "tool_use"),
    ],
)
@pytest.mark.parametrize("size", [1, 3, 100])
def test_message_events_rebuild_the_whole_message(text, reason, stop_reason, size):
    """The SDK's own accumulator, fed our events, gives the message the whole answer gives."""
    req = _chat_request(
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    )
    whole = Encoder(req, "m", created=0, tool_parser=Hermes).whole(_responses([text], reason))
    expected = anth.message(whole, "msg_1", _responses([text], reason)[-1])
    assert expected["stop_reason"] == stop_reason

    enc = Encoder(req, "m", created=0, tool_parser=Hermes)
    stream = anth.MessageStream("msg_1", "m")
    events = stream.start()
    responses = _responses(_pieces(text, size), reason)
    for resp in responses:
        events += stream.feed(resp, enc.chunk(resp))
    events += stream.finish(enc.usage_chunk(responses[-1].usage)["usage"])
    parsed = [e.decode().split("\n", 2) for e in events]
    assert all(
        name.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
        for name, data, _ in parsed
    )
    snapshot, bufs = None, {}
    for _, data, _ in parsed:
        snapshot = accumulate_event(
            event=json.loads(data.removeprefix("data: ")), current_snapshot=snapshot, json_bufs=bufs
        )
    got = snapshot.to_dict()
    got.pop("stop_details", None)
    assert got == expected
    names = [json.loads(d.removeprefix("data: "))["type"] for _, d, _ in parsed]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == len(expected["content"])


def test_the_stop_sequence_that_matched_is_named():
    # The matcher names the one that ended the text (the first complete), which the answer carries.
    matcher = StopStringMatcher(["END", "ab"])
    assert matcher.feed("xxa") == ("xx", False) and matcher.feed("bEND") == ("", True)
    assert matcher.matched == "ab"
    last = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP, stop_string="ab")
    whole = Encoder(_chat_request(), "m", created=0).whole([last])
    assert anth.message(whole, "i", last)["stop_sequence"] == "ab"
    eos = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_EOS)
    assert anth.message(whole, "i", eos)["stop_sequence"] is None


# ---- Responses: bodies ----


def test_a_responses_body_is_the_chat_body_that_asks_the_same():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "20C"}],
            },
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "text"}},
        "max_output_tokens": 12,
        "temperature": 0,
        "store": True,
        "metadata": {"k": "v"},
    }
    r = parse_responses(body, "r1", history, tool_parser="hermes")
    g = r.req.generate
    assert [(m.role, m.content, [c.name for c in m.tool_calls], m.tool_call_id) for m in g.messages] == [
        ("system", "Be brief.", [], ""),
        ("user", "Hi", [], ""),
        ("assistant", "Hello!", [], ""),
        ("user", "Weather?", [], ""),
        ("assistant", "", ["get_weather", "get_weather"], ""),  # one turn's calls together
        ("tool", "18C", [], "c1"),
        ("tool", "20C", [], "c2"),
    ]
    assert g.max_new_tokens == 12 and g.sampling.temperature == 0
    assert json.loads(g.sampling.structured_output.json_schema)["properties"] == SCHEMA["properties"]
    # The conversation kept for a later turn has no instructions.
    assert r.conversation[0] == {"role": "user", "content": "Hi"} and len(r.conversation) == 6
    assert r.echo["metadata"] == {"k": "v"} and r.echo["instructions"] == "Be brief."
    schema = {"type": "json_schema", "name": "o", "schema": SCHEMA, "strict": True}
    fmt = parse_responses({"input": "x", "text": {"format": schema}}, "r", [])
    assert fmt.req.generate.sampling.structured_output.json_schema


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": []}, "input", "non-empty"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
            "vision",
        ),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0]", "tools[0] must be"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
        ({"input": "x", "bogus": 1}, "bogus", "unrecognized"),
    ],
)
def test_bad_responses_bodies(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_responses(body, "r", [], tool_parser="hermes")
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


# ---- Responses: the stream ----


@pytest.mark.parametrize(
    "text, reason",
    [
        ("Hello there.", pb.FINISH_REASON_EOS),
        ("Cut", pb.FINISH_REASON_LENGTH),
        ("Sure. " + CALL, pb.FINISH_REASON_EOS),
    ],
)
@pytest.mark.parametrize("size", [1, 4, 100])
def test_response_events_end_with_the_whole_response(text, reason, size):
    req = _chat_request(
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    )
    echo = {"store": True}
    whole = Encoder(req, "m", created=0, tool_parser=Hermes).whole(_responses([text], reason))
    u = {"input_tokens": 7}
    expected = response("r1", "m", 0, echo, Said.of(whole), u)
    enc = Encoder(req, "m", created=0, tool_parser=Hermes)
    stream = ResponseStream("r1", "m", echo, created=0)
    events = stream.start()
    for resp in _responses(_pieces(text, size), reason):
        events += stream.feed(enc.chunk(resp))
    last, final = stream.finish(u)
    events += last
    bodies = [json.loads(e.decode().split("\n")[1].removeprefix("data: ")) for e in events]
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    assert final == expected and bodies[-1]["response"] == expected
    kinds = [b["type"] for b in bodies]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if reason == pb.FINISH_REASON_LENGTH else "response.completed")
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    assert kinds.count("response.output_item.added") == len(expected["output"])
    # Deltas add up to the text, and each item closes with what it holds.
    texts = "".join(b["delta"] for b in bodies if b["type"] == "response.output_text.delta")
    assert texts == "".join(
        c["text"] for i in expected["output"] if i["type"] == "message" for c in i["content"]
    )
    done = [b["item"] for b in bodies if b["type"] == "response.output_item.done"]
    assert done == expected["output"]


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", Stored({"id": f"r{i}"}, []))
    assert store.get("r0") is None and store.get("r1") is not None  # r1 used: r2 goes next
    store.put("r3", Stored({}, []))
    assert store.get("r2") is None and len(store) == 2 and store.delete("r1") and not store.delete("r1")
    none = ResponseStore(0)
    none.put("x", Stored({}, []))
    assert len(none) == 0


# ---- through the HTTP server ----


def test_x_api_key_and_each_apis_error_shape():
    async def test(session, url, frontend, server):
        body = {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        out = []
        for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": "k1"}, {"Authorization": "Bearer k1"}):
            async with session.post(f"{url}/v1/messages", json=body, headers=headers) as r:
                out.append((r.status, await r.json()))
        async with session.post(
            f"{url}/v1/responses", json={"input": "hi"}, headers={"x-api-key": "k1"}
        ) as r:
            out.append((r.status, await r.json()))
        async with session.get(f"{url}/v1/responses/nope", headers={"x-api-key": "k1"}) as r:
            out.append((r.status, await r.json()))
        return out

    out = serve(scripted("Hi", "!"), test, frontend_cls=Frontend, keys=ApiKeys(["k1"]))
    (s0, b0), (s1, b1), (s2, b2), (s3, b3), (s4, b4), (s5, b5) = out
    assert (s0, b0["type"], b0["error"]["type"]) == (401, "error", "authentication_error")
    assert s1 == 401 and "not valid" in b1["error"]["message"]
    assert (
        s2 == s3 == 200
        and b2["content"] == [{"type": "text", "text": "Hi!"}]
        and b2["usage"]["input_tokens"] == 3
    )
    assert s4 == 200 and b4["output"][0]["content"][0]["text"] == "Hi!" and b4["status"] == "completed"
    assert s5 == 404 and b5["error"]["code"] == "NOT_FOUND"  # OpenAI's shape on OpenAI's paths
