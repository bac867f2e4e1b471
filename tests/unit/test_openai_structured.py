"""OpenAI bodies with structured outputs and several choices, read into GenerateRequests, and answers with
several choices, echo and vLLM's prompt_logprobs (plain functions, no server)."""

from __future__ import annotations

import json

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.openai.encoder import Encoder
from router.openai.protocol import parse_chat, parse_completion
from tests.unit.test_openai_protocol import responses, tok


def test_structured_outputs_and_several_choices_are_read_into_the_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema, "strict": True},
            },
            "n": 3,
        },
        "r",
    )
    # Closed: no properties beyond "a" (test_strict_schemas.py).
    assert json.loads(chat.generate.sampling.structured_output.json_schema) == schema | {
        "additionalProperties": False
    }
    assert chat.generate.n == 3 and chat.num_choices == 3
    assert chat.params["sampling.structured_output.json_schema"] == "response_format"
    cases = {
        "guided_json": ({"type": "object"}, "json_schema"),
        "guided_regex": ("[a-z]+", "regex"),
        "guided_choice": (["yes", "no"], "choice"),
        "guided_grammar": ('root ::= "a"', "grammar"),
    }
    for field, (value, kind) in cases.items():
        g = parse_completion({"prompt": "x", field: value}, "r").generate
        assert g.sampling.structured_output.WhichOneof("kind") == kind
    g = parse_completion({"prompt": "x", "structured_outputs": {"json_object": True}}, "r").generate
    assert g.sampling.structured_output.json_object
    # Several prompts: one GenerateRequest each; best_of generates more and asks each token's logprob.
    req = parse_completion({"prompt": ["a", [5, 6], "c"], "n": 2, "best_of": 3}, "r")
    assert [g.request_id for g in req.generates] == ["r", "r/1", "r/2"]
    assert [g.text or list(g.token_ids) for g in req.generates] == ["a", [5, 6], "c"]
    assert all(g.n == 3 and g.top_logprobs == 1 for g in req.generates) and req.logprobs is None
    assert req.num_choices == 6
    echo = parse_completion({"prompt": "a", "echo": True, "logprobs": 2}, "r")
    assert echo.echo and echo.generate.prompt_logprobs == 2


def test_echo_prompt_logprobs_and_several_choices_in_the_answer():
    req = parse_completion({"prompt": "Hi there", "echo": True, "logprobs": 1, "n": 2}, "r")
    prompt = [tok(3, "Hi", 0.0), tok(4, " there", -2.0, [(9, " you", -0.5)])]
    for p in prompt:
        p.chosen.rank = 0 if p.chosen.token_id == 3 else 5
    first, second = responses(logprobs=True)
    a = pb.GenerateResponse(index=0, text="Hello", logprobs=first.logprobs, prompt_logprobs=prompt)
    b = pb.GenerateResponse(index=1, text="Yo", prompt_logprobs=prompt, finish_reason=pb.FINISH_REASON_LENGTH)
    last = pb.GenerateResponse(index=0, finish_reason=pb.FINISH_REASON_EOS, usage=second.usage)
    out = Encoder(req, "m", created=1, echo_texts=["Hi there"]).whole([a, b, last])
    c0, c1 = out["choices"]
    assert (c0["index"], c0["text"], c1["index"], c1["text"]) == (0, "Hi thereHello", 1, "Hi thereYo")
    lps = c0["logprobs"]
    assert lps["tokens"][:2] == ["Hi", " there"] and lps["token_logprobs"][:2] == [None, -2.0]
    assert lps["top_logprobs"][:2] == [None, {" you": -0.5}] and lps["text_offset"][:3] == [0, 2, 8]
    assert c1["finish_reason"] == "length" and c0["finish_reason"] == "stop"
    vllm = parse_completion({"prompt": "Hi there", "prompt_logprobs": 1}, "r")
    [choice] = Encoder(vllm, "m", created=1).whole([a, last])["choices"]
    assert choice["prompt_logprobs"] == [
        None,
        {
            "4": {"logprob": -2.0, "rank": 5, "decoded_token": " there"},
            "9": {"logprob": -0.5, "rank": 0, "decoded_token": " you"},
        },
    ]
