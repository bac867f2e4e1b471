"""The sampling fields the engine's logits processors apply (logit_bias, min_tokens, bad_words) and the
chat options, as the router checks and resolves them for both APIs (router/sampling_checks.py, chat.py):
OpenAI's and vLLM's ranges, each refusal naming its field."""

from __future__ import annotations

import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.sampling_checks import with_bad_words
from router.tokenizer import Tokenizer
from router.validation import Limits, ValidationError, validate_request
from tests.conftest import ROOT

LIMITS = Limits(vocab_size=1000, max_model_len=128)
SMOLLM2 = ROOT / "models" / "smollm2"


def validate(**kw):
    sampling = kw.pop("sampling", {})
    kw.setdefault("token_ids", [1, 2, 3])
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kw)
    return validate_request(
        req, LIMITS, tokenize_words=lambda w: [ord(c) for c in w], render_chat=lambda p: [1]
    )


def refused(**kw) -> ValidationError:
    with pytest.raises(ValidationError) as e:
        validate(**kw)
    return e.value


def test_logit_bias_and_min_tokens_travel_to_the_worker():
    v = validate(max_new_tokens=10, sampling=dict(logit_bias={7: 100, 3: -100.0, 5: 0.5}, min_tokens=10))
    assert v.sampling.logit_bias == ((3, -100.0), (5, 0.5), (7, 100.0))
    assert v.sampling.min_tokens == 10
    sent = v.sampling.to_proto()
    assert dict(sent.logit_bias) == {3: -100.0, 5: 0.5, 7: 100.0} and sent.min_tokens == 10


@pytest.mark.parametrize(
    "kw, field, words",
    [
        (dict(sampling=dict(logit_bias={1000: 1})), "sampling.logit_bias", ["1000", "vocab_size 1000"]),
        (dict(sampling=dict(logit_bias={5: 100.5})), "sampling.logit_bias", ["[-100, 100]", "100.5"]),
        (dict(sampling=dict(logit_bias={5: float("nan")})), "sampling.logit_bias", ["[-100, 100]"]),
        (dict(sampling=dict(logit_bias={i: 1 for i in range(301)})), "sampling.logit_bias", ["301", "300"]),
        (
            dict(max_new_tokens=4, sampling=dict(min_tokens=5)),
            "sampling.min_tokens",
            ["5", "max_new_tokens 4"],
        ),
        (dict(sampling=dict(min_tokens=300)), "sampling.min_tokens", ["the default max_new_tokens"]),
        (dict(sampling=dict(bad_words=[" "])), "sampling.bad_words[0]", ["not all spaces"]),
        (dict(sampling=dict(bad_words=["x" * 257])), "sampling.bad_words[0]", ["256"]),
        (
            dict(sampling=dict(bad_words_token_ids=[pb.TokenIds(ids=[1]), pb.TokenIds(ids=[5, 1000])])),
            "sampling.bad_words_token_ids[1]",
            ["1000"],
        ),
        (
            dict(sampling=dict(bad_words_token_ids=[pb.TokenIds()])),
            "sampling.bad_words_token_ids[0]",
            ["1 to"],
        ),
        (dict(sampling=dict(bad_words=["\u4e16"])), "sampling.bad_words[0]", ["19990", "vocab_size"]),
    ],
)
def test_bad_sampling_fields_are_refused_naming_the_field(kw, field, words):
    e = refused(**kw)
    assert e.field == field and all(w in str(e) for w in words), str(e)


def test_bad_words_are_tokenized_as_vllm_does_with_and_without_a_leading_space():
    """vLLM's update_from_tokenizer: each word as is, and with a space before it where that gives another
    first token of the same length; ids given directly come first."""
    tok = Tokenizer.from_pretrained(str(SMOLLM2)) if (SMOLLM2 / "tokenizer.json").is_file() else None
    if tok is None:
        pytest.skip("models/smollm2 is not built")
    cfg = with_bad_words(
        validate(sampling=dict(bad_words_token_ids=[pb.TokenIds(ids=[9])])).sampling,
        ["hello", " Paris"],
        tok.encode_words,
        49152,
    )
    enc = tok.encode_words
    assert cfg.bad_words_token_ids == (
        (9,),
        tuple(enc("hello")),
        tuple(enc(" hello")),
        tuple(enc("Paris")),
        tuple(enc(" Paris")),
    )
    assert len(enc("hello")) == len(enc(" hello")) == 1 and enc("hello") != enc(" hello")


def chat(*messages, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages], **kw)


def test_chat_options_and_tool_turns_reach_the_template():
    seen = []
    req = chat(
        dict(role="user", content="weather?"),
        dict(
            role="assistant",
            tool_calls=[pb.ToolCall(id="c1", name="get_weather", arguments_json='{"city": "Paris"}')],
        ),
        dict(role="tool", content="18C", tool_call_id="c1", name="get_weather"),
        tools=[pb.Tool(name="get_weather", description="Weather now", parameters_json='{"type": "object"}')],
        continue_final_message=True,
    )
    validate_request(req, LIMITS, render_chat=lambda p: seen.append(p) or [1])
    (prompt,) = seen
    assert prompt.messages[1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert prompt.messages[2] == {
        "role": "tool",
        "content": "18C",
        "tool_call_id": "c1",
        "name": "get_weather",
    }
    assert prompt.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather now",
                "parameters": {"type": "object"},
            },
        }
    ]
    # continue_final_message alone turns the generation prompt off (vLLM wants both said).
    assert (prompt.add_generation_prompt, prompt.continue_final_message) == (False, True)


@pytest.mark.parametrize(
    "req, field",
    [
        (
            chat(dict(role="user", content="x"), continue_final_message=True, add_generation_prompt=True),
            "continue_final_message",
        ),
        (pb.GenerateRequest(text="x", add_generation_prompt=False), "add_generation_prompt"),
        (pb.GenerateRequest(text="x", tools=[pb.Tool(name="f")]), "tools"),
        (chat(dict(role="user", content="x"), tools=[pb.Tool(name="bad name")]), "tools[0].function.name"),
        (
            chat(dict(role="user", content="x"), tools=[pb.Tool(name="f"), pb.Tool(name="f")]),
            "tools[1].function.name",
        ),
        (
            chat(dict(role="user", content="x"), tools=[pb.Tool(name="f", parameters_json="[1]")]),
            "tools[0].function.parameters",
        ),
        (
            chat(dict(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments_json="{oops")])),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (chat(dict(role="user", tool_calls=[pb.ToolCall(name="f")])), "messages[0].tool_calls"),
        (chat(dict(role="robot", content="x")), "messages[0].role"),
    ],
)
def test_bad_chat_options_are_refused_naming_the_field(req, field):
    with pytest.raises(ValidationError) as e:
        validate_request(req, LIMITS, tokenize=lambda t: [1], render_chat=lambda p: [1])
    assert e.value.field == field, str(e.value)
