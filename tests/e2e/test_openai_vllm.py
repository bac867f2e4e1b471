"""The rest of the OpenAI surface and vLLM's extensions through the real processes on models/smollm2, with
the official `openai` client, against the shapes vLLM's protocol files define (vllm/entrypoints/serve/
tokenize/protocol.py, instrumentator/basic.py and health.py, openai/chat_completion/protocol.py): /tokenize
and /detokenize, /version, /ping, /metrics on the HTTP port, /v1/models/{id}, include_stop_str_in_output,
stop_token_ids without their text, add_generation_prompt and continue_final_message applied, tool calling
(a real tool call parsed out of SmolLM2's answer), and one 400 message per refused value. One stack for the
module."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.conftest import post_json as post
from tests.e2e.test_openai import SMOLLM2, client, http_get

pytestmark = pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(),
    reason="models/smollm2 is not built (`make model-smollm2` builds it; `make test` does it first)",
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# One worked example is enough for SmolLM2 (whose template ignores `tools`) to answer in hermes' format.
ONE_SHOT = [
    {"role": "system", "content": "You answer weather questions with a tool call."},
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack[1]


def test_tokenize_detokenize_version_ping_metrics_and_the_model_card(stack):
    status, text = post(stack, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and set(text) == {"count", "max_model_len", "tokens", "token_strs"}
    assert text["count"] == len(text["tokens"]) == 2 and text["token_strs"] == ["Hello", "Ġworld"]
    assert text["max_model_len"] == 8192
    assert post(stack, "/detokenize", {"tokens": text["tokens"]}) == (200, {"prompt": "Hello world"})
    # A conversation counts as the chat endpoint renders it: its prompt_tokens.
    status, chat = post(stack, "/tokenize", {"messages": QUESTION})
    answer = client(stack).chat.completions.create(
        model="smollm2", messages=QUESTION, max_completion_tokens=1, temperature=0
    )
    assert status == 200 and chat["count"] == answer.usage.prompt_tokens and chat["token_strs"] is None
    _, bare = post(stack, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False})
    # "<|im_start|>assistant\n" is the generation prompt: 4 tokens.
    assert chat["tokens"][: bare["count"]] == bare["tokens"] and chat["count"] == bare["count"] + 4

    status, version = http_get(stack, "/version")
    assert status == 200 and set(version) == {"version"}
    assert http_get(stack, "/ping") == (200, {"status": "SERVING"})
    port = stack["http_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "tpserve_time_to_first_token_seconds_count" in metrics
    status, card = http_get(stack, "/v1/models/smollm2")
    assert status == 200 and card["id"] == "smollm2" and card["object"] == "model"
    assert http_get(stack, "/v1/models/other")[0] == 404
    # The model named by any path to its directory (issue 19's bug).
    got = client(stack).completions.create(model=str(SMOLLM2.resolve()) + "/", prompt="Hi", max_tokens=1)
    assert got.model == "smollm2"


def test_stop_strings_and_stop_tokens_leave_the_text_unless_asked_to_stay(stack):
    c = client(stack)
    kw = dict(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0)
    plain = c.completions.create(**kw).choices[0].text
    assert plain.startswith(" Paris.")
    period = post(stack, "/tokenize", {"prompt": ".", "add_special_tokens": False})[1]["tokens"]
    by_token = c.completions.create(**kw, extra_body={"stop_token_ids": period})
    assert by_token.choices[0].text == " Paris" and by_token.choices[0].finish_reason == "stop"
    assert by_token.usage.completion_tokens == 2  # the stop token counts, as in vLLM
    kept = c.completions.create(
        **kw, extra_body={"stop_token_ids": period, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == " Paris."
    assert c.completions.create(**kw, stop=["aris"]).choices[0].text == " P"
    kept = c.completions.create(**kw, stop=["aris"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " Paris"


def test_continue_final_message_and_add_generation_prompt_change_the_prompt(stack):
    c = client(stack)
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    cont = c.chat.completions.create(
        model="smollm2",
        messages=prefill,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    assert cont.choices[0].message.content.startswith(" Paris")  # continued, not a new turn
    _, rendered = post(stack, "/tokenize", {"messages": prefill, "continue_final_message": True})
    assert cont.usage.prompt_tokens == rendered["count"]
    bare = c.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_completion_tokens=1,
        temperature=0,
        extra_body={"add_generation_prompt": False},
    )
    with_prompt = c.chat.completions.create(model="smollm2", messages=QUESTION, max_completion_tokens=1)
    assert bare.usage.prompt_tokens == with_prompt.usage.prompt_tokens - 4  # "<|im_start|>assistant\n"


def test_tool_calls_with_the_official_client_whole_streamed_and_replayed(stack):
    c = client(stack)
    kw = dict(model="smollm2", messages=ONE_SHOT, tools=[WEATHER], temperature=0, max_completion_tokens=40)
    whole = c.chat.completions.create(**kw)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"

    # The call and its result replayed: accepted, and the model answers in text.
    history = [
        *ONE_SHOT,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"},
    ]
    after = c.chat.completions.create(**(kw | {"messages": history, "max_completion_tokens": 8}))
    assert after.choices[0].message.content and after.choices[0].finish_reason in ("stop", "length")
    # auto on a plain question: text.
    plain = c.chat.completions.create(**(kw | {"messages": QUESTION}))
    assert "Paris" in plain.choices[0].message.content and plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (dict(temperature=3), "temperature", "must be in [0, 2], got 3"),
        (dict(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0"),
        (dict(max_tokens=-1), "max_tokens", "max_tokens must be at least 1, got -1"),
        (dict(extra_body={"logit_bias": {"49152": 1}}), "logit_bias", "not below vocab_size 49152"),
        (dict(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens", "above max_tokens 4"),
        (dict(extra_body={"echo_back": True}), "echo_back", "unrecognized request field"),
        (dict(extra_body={"use_beam_search": True}), "use_beam_search", "not supported"),
        (dict(extra_body={"guided_regex": "a(b"}), "guided_regex", "does not compile"),
        (dict(extra_body={"guided_choice": ["a"], "ignore_eos": True}), "ignore_eos", "cannot be used with"),
    ],
)
def test_refusals_name_the_field(stack, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client(stack).chat.completions.create(model="smollm2", messages=QUESTION, **extra)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
