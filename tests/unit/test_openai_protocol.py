"""The OpenAI-compatible API's translation, without a server: JSON bodies -> GenerateRequest,
GenerateResponses -> OpenAI's objects, RequestFailed -> HTTP errors (router/openai/protocol.py, encoder.py,
errors.py)."""

from __future__ import annotations

import json

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.frontend import RequestFailed
from router.openai.encoder import Encoder
from router.openai.errors import ApiError, from_failure
from router.openai.protocol import parse_chat, parse_completion

# ---- requests ----


def test_completion_body_becomes_a_generate_request():
    body = {
        "model": "m",
        "prompt": "Once upon",
        "max_tokens": 20,
        "temperature": 0,
        "top_p": 0.9,
        "seed": 7,
        "stop": "\n",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "user": "accepted, no effect",
    }
    req = parse_completion(body, "r1")
    g = req.generate
    assert (g.request_id, g.text, g.max_new_tokens, list(g.stop)) == ("r1", "Once upon", 20, ["\n"])
    assert g.sampling.temperature == 0 and g.sampling.HasField("temperature")
    assert g.sampling.top_p == pytest.approx(0.9) and g.sampling.seed == 7
    assert g.sampling.presence_penalty == 0.5 and g.sampling.frequency_penalty == -0.5
    # Unset fields stay unset: the server's defaults apply, as on gRPC.
    assert not g.sampling.HasField("top_k") and not g.sampling.HasField("repetition_penalty")
    assert (req.model, req.stream, req.include_usage, req.logprobs, req.chat) == (
        "m",
        False,
        False,
        None,
        False,
    )


def test_completion_defaults_to_16_tokens_as_openai_and_chat_to_the_servers_default():
    assert parse_completion({"prompt": "x"}, "r").generate.max_new_tokens == 16
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]}, "r").generate
    assert not chat.HasField("max_new_tokens")


@pytest.mark.parametrize(
    "prompt, text, ids",
    [("hi", "hi", []), (["hi"], "hi", []), ([5, 6, 7], "", [5, 6, 7]), ([[5, 6]], "", [5, 6])],
)
def test_completion_prompt_forms(prompt, text, ids):
    g = parse_completion({"prompt": prompt}, "r").generate
    assert g.text == text and list(g.token_ids) == ids


def test_completion_logprobs_asks_for_at_least_one_alternative():
    # The proto's 0 means no logprobs; OpenAI's 0 means the chosen token's only.
    req = parse_completion({"prompt": "x", "logprobs": 0}, "r")
    assert req.generate.top_logprobs == 1 and req.logprobs == 0
    req = parse_completion({"prompt": "x", "logprobs": 3}, "r")
    assert req.generate.top_logprobs == 3 and req.logprobs == 3


def test_chat_body_becomes_messages():
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 5,
        "max_completion_tokens": 9,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["x", "y"],
        "top_k": -1,  # vLLM's "no cut"
    }
    req = parse_chat(body, "r")
    g = req.generate
    assert [(m.role, m.content) for m in g.messages] == [
        ("system", "Be brief."),
        ("user", "a\nb"),
        ("assistant", ""),
    ]
    assert g.max_new_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert (g.top_logprobs, req.logprobs, req.stream, req.include_usage) == (2, 2, True, True)
    assert list(g.stop) == ["x", "y"] and g.sampling.top_k == 0 and g.sampling.HasField("top_k")
    assert req.params["max_new_tokens"] == "max_completion_tokens"


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "x", "n": 17}, "n", "must be in [1, 16]"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of", "must be at least n"),
        ({"prompt": "x", "best_of": 3, "stream": True}, "best_of", "cannot be used with stream"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "set one of"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "must be"),
        (
            {"prompt": "x", "structured_outputs": {"structural_tag": "t"}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unrecognized request field"),
        ({"prompt": "x", "tools": []}, "tools", "of /v1/chat/completions only"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number, got a string"),
        ({"prompt": "x", "temperature": True}, "temperature", "must be a number, got a boolean"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens must be at least 1, got -1"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
        ({"prompt": "x", "seed": -3}, "seed", "must be in [0,"),
        ({"prompt": "x", "stop": [1]}, "stop", "a string or an array of strings"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"prompt": ["a", []]}, "prompt[1]", "is empty"),
        ({"prompt": []}, "prompt", "must be a string"),
        ({}, "prompt", "must be a string"),
        ({"prompt": "x", "model": 3}, "model", "must be a string"),
    ],
)
def test_completion_bodies_refused_before_the_frontend(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_completion(body, "r")
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"
    assert e.value.body()["error"]["code"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].image_url",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ],
)
def test_chat_bodies_refused_before_the_frontend(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body, "r")
    assert e.value.status == 400 and e.value.param == param


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(ApiError) as e:
        parse_completion(["prompt"], "r")
    assert e.value.status == 400 and "JSON object" in e.value.message


# ---- errors ----


@pytest.mark.parametrize(
    "code, status, kind",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
    ],
)
def test_status_codes_map_to_http(code, status, kind):
    e = from_failure(RequestFailed(code, "why"), {})
    assert e.status == status
    assert e.body() == {"error": {"message": "why", "type": kind, "param": None, "code": code.name}}


def test_fields_and_messages_are_renamed_to_the_clients_names():
    completion = parse_completion({"prompt": [1, 2]}, "r").params
    chat = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}, "r"
    ).params
    bad = grpc.StatusCode.INVALID_ARGUMENT
    e = from_failure(
        RequestFailed(bad, "sampling.temperature must be >= 0, got -1.0", "sampling.temperature"), chat
    )
    assert (e.param, e.message) == ("temperature", "temperature must be >= 0, got -1.0")
    e = from_failure(
        RequestFailed(bad, "token_ids[1] = 5000 is not below vocab_size 1024", "token_ids[1]"), completion
    )
    assert (e.param, e.message) == ("prompt[1]", "prompt[1] = 5000 is not below vocab_size 1024")
    msg = "prompt length 5 + max_new_tokens 2000 = 2005 exceeds max_model_len 1024"
    e = from_failure(RequestFailed(bad, msg, "max_new_tokens"), chat)
    assert e.param == "max_completion_tokens" and e.message.startswith(
        "prompt length 5 + max_completion_tokens 2000"
    )
    e = from_failure(
        RequestFailed(bad, "top_logprobs 30 is above the limit of 20", "top_logprobs"), completion
    )
    assert (e.param, e.message) == ("logprobs", "logprobs 30 is above the limit of 20")
    e = from_failure(RequestFailed(bad, "messages[0].role is 'robot'; ...", "messages[0].role"), chat)
    assert e.param == "messages[0].role"
    # Other fields the message mentions get the client's names too.
    msg = "sampling.min_tokens 5 is above max_new_tokens 4"
    e = from_failure(RequestFailed(bad, msg, "sampling.min_tokens"), chat)
    assert (e.param, e.message) == ("min_tokens", "min_tokens 5 is above max_completion_tokens 4")


# ---- responses ----


def tok(token_id, text, logprob, top=()):
    return pb.Logprobs(
        chosen=pb.TokenLogprob(token_id=token_id, text=text, logprob=logprob),
        top=[pb.TokenLogprob(token_id=i, text=t, logprob=lp) for i, t, lp in top],
    )


def responses(finish=pb.FINISH_REASON_EOS, logprobs=False):
    lp = [tok(5, "Hel", -0.5, [(5, "Hel", -0.5), (6, "He", -1.5)]), tok(6, "lo", float("-inf"))]
    usage = pb.Usage(prompt_tokens=4, completion_tokens=3)
    return [
        pb.GenerateResponse(request_id="r", token_ids=[5, 6], text="Hello", logprobs=lp if logprobs else []),
        pb.GenerateResponse(request_id="r", token_ids=[7], text="", finish_reason=finish, usage=usage),
    ]


def test_whole_completion_has_openais_shape():
    req = parse_completion({"prompt": "x", "logprobs": 1}, "r")
    out = Encoder(req, "tiny", created=123).whole(responses(logprobs=True))
    assert out == {
        "id": "cmpl-r",
        "object": "text_completion",
        "created": 123,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "Hello",
                "logprobs": {
                    "tokens": ["Hel", "lo"],
                    "token_logprobs": [-0.5, -9999.0],  # -inf is not JSON
                    "top_logprobs": [{"Hel": -0.5}, {}],
                    "text_offset": [0, 3],
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    }
    json.dumps(out, allow_nan=False)


def test_whole_chat_has_openais_shape():
    req = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, "r"
    )
    out = Encoder(req, "smollm2", created=1).whole(responses(finish=pb.FINISH_REASON_LENGTH, logprobs=True))
    assert out["id"] == "chatcmpl-r" and out["object"] == "chat.completion"
    (choice,) = out["choices"]
    assert (
        choice["message"] == {"role": "assistant", "content": "Hello"} and choice["finish_reason"] == "length"
    )
    first = choice["logprobs"]["content"][0]
    assert first == {
        "token": "Hel",
        "logprob": -0.5,
        "bytes": [72, 101, 108],
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
            {"token": "He", "logprob": -1.5, "bytes": [72, 101]},
        ],
    }
    assert out["usage"]["total_tokens"] == 7


def test_chat_stream_chunks():
    req = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "r",
    )
    enc = Encoder(req, "m", created=1)
    [role] = enc.role_chunks()
    assert role["object"] == "chat.completion.chunk" and role["usage"] is None
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first, last = (enc.chunk(r) for r in responses(finish=pb.FINISH_REASON_STOP))
    assert (
        first["choices"][0]["delta"] == {"content": "Hello"} and first["choices"][0]["finish_reason"] is None
    )
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    usage = enc.usage_chunk(responses()[1].usage)
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
    }


def test_completion_stream_chunks_skip_held_back_text_and_carry_offsets_across_chunks():
    req = parse_completion({"prompt": "x", "stream": True, "logprobs": 0}, "r")
    enc = Encoder(req, "m", created=1)
    no_logprobs = Encoder(parse_completion({"prompt": "x", "stream": True}, "r"), "m")
    assert no_logprobs.chunk(pb.GenerateResponse(token_ids=[1], text="")) is None  # text held back
    a = enc.chunk(pb.GenerateResponse(token_ids=[1], text="ab", logprobs=[tok(1, "ab", -1.0)]))
    b = enc.chunk(pb.GenerateResponse(token_ids=[2], text="c", logprobs=[tok(2, "c", -2.0)]))
    assert a["choices"][0]["logprobs"]["text_offset"] == [0] and b["choices"][0]["logprobs"][
        "text_offset"
    ] == [2]
    assert "usage" not in a  # only with stream_options.include_usage
