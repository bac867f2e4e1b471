"""Anthropic's Messages API and OpenAI's Responses API through the real processes on models/smollm2, with each
vendor's own client (`anthropic`, `openai`): every answer equal to the chat completion of the same
conversation (greedy), streams equal to the whole answers (each SDK's own accumulator reads the events),
a forced tool call and an auto-parsed one, the tool loop fed back, count_tokens, stored responses
continued and read back, and errors in each API's shape. The session's SmolLM2 stack (hermes tool calls)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import post_json as post
from tests.e2e.test_openai import SMOLLM2, client

# A 1x1 PNG as an Anthropic base64 image source.
PNG = {
    "type": "base64",
    "media_type": "image/png",
    "data": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC",
}

pytestmark = pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(),
    reason="models/smollm2 is not built (`make model-smollm2` builds it; `make test` does it first)",
)

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "The weather in a city now", "input_schema": SCHEMA}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": TOOL["description"], "parameters": SCHEMA},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": TOOL["description"],
    "parameters": SCHEMA,
}
# One worked example is enough for SmolLM2 (whose template ignores `tools`) to answer in hermes' format.
EXAMPLE_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": EXAMPLE_CALL},
    {"role": "user", "content": "What is the weather in Paris?"},
]
ONE_SHOT_SYSTEM = "You answer weather questions with a tool call."
# The call fed back with its result, as the chat endpoint reads it (the same turns for both APIs).
CALL_ID = "call_w1"
LOOP = [
    {"role": "system", "content": ONE_SHOT_SYSTEM},
    *ONE_SHOT,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18C", "name": "get_weather"},
]


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack[1]


def claude(info) -> anthropic.Anthropic:
    # max_retries=0: the client retries 429 and 5xx by itself, which would hide what the server said.
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{info['http_port']}", api_key="unused", max_retries=0
    )


_CHATS: dict[str, openai.types.chat.ChatCompletion] = {}


def chat(info, messages, **kw) -> openai.types.chat.ChatCompletion:
    """The greedy chat completion of a conversation, asked once for the module (both APIs compare with the
    same conversations)."""
    key = json.dumps([messages, kw], sort_keys=True)
    if key not in _CHATS:
        _CHATS[key] = client(info).chat.completions.create(
            model="smollm2", messages=messages, temperature=0, **kw
        )
    return _CHATS[key]


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ---- Anthropic ----


def test_messages_equal_the_chat_completion_whole_and_streamed_and_count_tokens(stack):
    c = claude(stack)
    # The SDK (2.x) dropped temperature from its arguments; the API still reads it from the body.
    kw = dict(model="smollm2", max_tokens=24, system=SYSTEM, extra_body={"temperature": 0})
    msg = c.messages.create(messages=[{"role": "user", "content": QUESTION}], **kw)
    expected = chat(
        stack,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_completion_tokens=24,
    )
    (text,) = msg.content
    assert text.type == "text" and text.text == expected.choices[0].message.content
    assert msg.stop_reason == STOP_REASONS[expected.choices[0].finish_reason]
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (
        expected.usage.prompt_tokens,
        expected.usage.completion_tokens,
    )
    assert msg.id.startswith("msg_") and msg.model == "smollm2" and msg.role == "assistant"

    # Streamed: the SDK's accumulator rebuilds the same message from the events.
    with c.messages.stream(messages=[{"role": "user", "content": QUESTION}], **kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude={"id"}) == msg.model_dump(exclude={"id"})
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]

    # A stop sequence: stop_reason says so, and names the one of several that matched.
    cut = c.messages.create(
        messages=[{"role": "user", "content": QUESTION}], stop_sequences=["Rome", "Paris"], **kw
    )
    if "Paris" in text.text:
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Paris"
        assert cut.content[0].text == text.text[: text.text.index("Paris")]

    counted = c.messages.count_tokens(
        model="smollm2", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == msg.usage.input_tokens


def test_messages_tool_use_forced_auto_and_the_result_fed_back(stack):
    c = claude(stack)
    kw = dict(model="smollm2", max_tokens=40, tools=[TOOL], extra_body={"temperature": 0})
    # Forced: the grammar makes the call, its input valid under the schema.
    forced = c.messages.create(
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tool_choice={"type": "tool", "name": "get_weather"},
        **kw,
    )
    (call,) = forced.content
    assert call.type == "tool_use" and call.name == "get_weather" and forced.stop_reason == "tool_use"
    jsonschema.validate(call.input, SCHEMA)
    with c.messages.stream(
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tool_choice={"type": "tool", "name": "get_weather"},
        **kw,
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", call.name, call.input)]

    # Auto (hermes): the model's own call parsed out of its text, as the chat endpoint parses it.
    auto = c.messages.create(system=ONE_SHOT_SYSTEM, messages=ONE_SHOT, **kw)
    expected = chat(
        stack,
        [{"role": "system", "content": ONE_SHOT_SYSTEM}, *ONE_SHOT],
        tools=[CHAT_TOOL],
        max_completion_tokens=40,
    )
    (chat_call,) = expected.choices[0].message.tool_calls
    (use,) = [b for b in auto.content if b.type == "tool_use"]
    assert (use.name, use.input) == (chat_call.function.name, json.loads(chat_call.function.arguments))
    assert auto.stop_reason == "tool_use"

    # The loop: the call and its result fed back; the answer is the chat completion's of the same turns.
    assert use.input == {"city": "Paris"}
    turns = [
        *ONE_SHOT,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": CALL_ID, "name": use.name, "input": use.input}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL_ID, "content": "18C"}]},
    ]
    after = c.messages.create(system=ONE_SHOT_SYSTEM, messages=turns, **(kw | {"max_tokens": 16}))
    expected = chat(stack, LOOP, tools=[CHAT_TOOL], max_completion_tokens=16)
    said = "".join(b.text for b in after.content if b.type == "text")
    assert said == (expected.choices[0].message.content or "")


@pytest.mark.parametrize(
    "body, status, kind, words",
    [
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_request_error",
            "max_tokens: Field required",
        ),
        (
            {"max_tokens": 8, "model": "claude-x", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "not_found_error",
            "claude-x",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": "x"}],
            },
            400,
            "invalid_request_error",
            "tools[0].input_schema",
        ),
        (
            # A schema its grammar cannot compile, forced.
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [
                    {
                        "name": "f",
                        "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    }
                ],
                "tool_choice": {"type": "any"},
            },
            400,
            "invalid_request_error",
            "tool_choice",
        ),
        (
            # An image block is the chat's image part: refused by the media policy's last check.
            {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": PNG}]}]},
            400,
            "invalid_request_error",
            "the served model does not take images",
        ),
    ],
)
def test_messages_errors_in_anthropics_shape(stack, body, status, kind, words):
    got, answer = post(stack, "/v1/messages", {"model": "smollm2"} | body)
    assert got == status and answer["type"] == "error" and answer["error"]["type"] == kind
    assert words in answer["error"]["message"]


def test_messages_errors_through_the_sdk(stack):
    c = claude(stack)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="smollm2", max_tokens=0, messages=[{"role": "user", "content": "hi"}])


# ---- Responses ----


def test_responses_equal_the_chat_completion_whole_streamed_stored_and_continued(stack):
    o = client(stack)
    kw = dict(model="smollm2", instructions=SYSTEM, temperature=0, max_output_tokens=24)
    r = o.responses.create(input=QUESTION, **kw)
    expected = chat(
        stack,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_completion_tokens=24,
    )
    assert r.output_text == expected.choices[0].message.content and r.output[0].type == "message"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        expected.usage.prompt_tokens,
        expected.usage.completion_tokens,
    )
    assert r.status == ("incomplete" if expected.choices[0].finish_reason == "length" else "completed")

    with o.responses.stream(input=QUESTION, **kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert streamed.output_text == r.output_text and streamed.usage == r.usage
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    assert "response.output_text.delta" in kinds

    # Stored: read back, and continued (the instructions are this request's own, as OpenAI's).
    assert o.responses.retrieve(r.id).output_text == r.output_text
    follow = "And of Germany?"
    r2 = o.responses.create(input=follow, previous_response_id=r.id, **kw)
    turns = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": follow},
    ]
    assert r2.output_text == chat(stack, turns, max_completion_tokens=24).choices[0].message.content
    assert r2.previous_response_id == r.id
    o.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        o.responses.retrieve(r2.id)


def test_responses_function_calls_forced_auto_and_outputs_fed_back(stack):
    o = client(stack)
    kw = dict(model="smollm2", temperature=0, max_output_tokens=40, tools=[RESPONSES_TOOL])
    forced = o.responses.create(
        input="Weather in Oslo?", tool_choice={"type": "function", "name": "get_weather"}, **kw
    )
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    with o.responses.stream(
        input="Weather in Oslo?", tool_choice={"type": "function", "name": "get_weather"}, **kw
    ) as s:
        streamed = s.get_final_response()
    assert [(i.type, i.name, i.arguments) for i in streamed.output] == [
        ("function_call", call.name, call.arguments)
    ]

    auto = o.responses.create(instructions=ONE_SHOT_SYSTEM, input=ONE_SHOT, **kw)
    (use,) = [i for i in auto.output if i.type == "function_call"]
    assert use.name == "get_weather" and json.loads(use.arguments) == {"city": "Paris"}

    # The loop: the call and its output fed back as items; the answer is the chat completion's.
    items = [
        *ONE_SHOT,
        {"type": "function_call", "call_id": CALL_ID, "name": use.name, "arguments": use.arguments},
        {"type": "function_call_output", "call_id": CALL_ID, "output": "18C"},
    ]
    after = o.responses.create(instructions=ONE_SHOT_SYSTEM, input=items, **(kw | {"max_output_tokens": 16}))
    expected = chat(stack, LOOP, tools=[CHAT_TOOL], max_completion_tokens=16)
    assert after.output_text == (expected.choices[0].message.content or "")


def test_responses_errors_in_openais_shape(stack):
    o = client(stack)
    with pytest.raises(openai.NotFoundError) as e:
        o.responses.create(model="gpt-x", input="hi")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        o.responses.create(model="smollm2", input="hi", max_output_tokens=0)
    assert "max_output_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        o.responses.create(
            model="smollm2",
            input="hi",
            tools=[{"type": "function", "name": "f", "parameters": "x"}],
            tool_choice="none",
        )
    assert "tools[0]" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        o.responses.create(model="smollm2", input="hi", previous_response_id="resp_missing")
    assert e.value.body["param"] == "previous_response_id"
