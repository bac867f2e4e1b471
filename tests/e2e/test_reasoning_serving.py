"""A reasoning model through the real processes: a tiny random Qwen3 whose chat template opens a think block
(as Qwen3-Thinking-2507's does), served with --reasoning-parser qwen3 and two --served-model-name names. One
stack for the module.

Random weights never close the block themselves, so the thinking budget does: the token after the budget is
the end tag, forced. The split is checked against the raw output: the token ids of the same request decoded
by transformers are the reasoning, `</think>`, then the content; the reasoning tokens are what a plain
greedy completion of the prompt gives, the content what it gives after the closed block. Whole and streamed
answers agree; include_reasoning false, enable_thinking false (chat_template_kwargs), reasoning_effort, a
forced tool call and a JSON schema after the think block; the served names in /v1/models and `model`."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest
import torch
from tokenizers import AddedToken

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.model_families import LOGIT_STD, hf_config

# Qwen3-style ChatML; thinking on unless enable_thinking is false (then an empty, closed block, as Qwen3's).
TEMPLATE = (
    "{%- if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n"
    "{%- endif %}"
    "{%- if tools %}<|im_start|>system\n{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)
NAMES = ("qwen3-think", "thinker")
BUDGET = 5
MAX_TOKENS = 16
ASK = [{"role": "user", "content": "What is two plus two?"}]
GREEDY = {"temperature": 0.0}


def build(out):
    """A random Qwen3 (tests/model_families.py's shapes, a larger vocabulary) with a byte-level BPE
    tokenizer whose <think> and </think> are added tokens, not special ones (as Qwen3's own: they stay in
    the decoded text)."""
    from transformers import Qwen3ForCausalLM

    from shard_worker.model.builder import build_tokenizer

    config = hf_config("qwen3")
    config.vocab_size = 512  # room for a byte-level alphabet (256) and some merges
    tokenizer = build_tokenizer(config.vocab_size - 2, config.max_position_embeddings)
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    assert len(tokenizer) == config.vocab_size
    tokenizer.chat_template = TEMPLATE
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, LOGIT_STD / config.hidden_size**0.5)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return tokenizer


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = tmp_path_factory.mktemp("qwen3-think")
    tokenizer = build(model)
    flags = ("--http-port", "0", "--dtype", "float32", "--reasoning-parser", "qwen3")
    with launch(model, *flags, "--served-model-name", *NAMES) as (target, info):
        with (
            grpc.insecure_channel(target) as channel,
            httpx.Client(base_url=f"http://127.0.0.1:{info['http_port']}", timeout=120) as http,
        ):
            yield generation_pb2_grpc.GenerationStub(channel), http, tokenizer


def _grpc(stub, **fields) -> tuple[list[int], str, str, pb.Usage]:
    ids, reasoning, text, usage = [], "", "", None
    for resp in stub.Generate(pb.GenerateRequest(**fields)):
        ids += resp.token_ids
        reasoning += resp.reasoning_text
        text += resp.text
        if resp.HasField("usage"):
            usage = resp.usage
    return ids, reasoning, text, usage


def _prompt(tokenizer, **kwargs) -> list[int]:
    """ASK rendered by transformers, as the router renders it (the template writes its own specials)."""
    text = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _messages(messages) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def _chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": NAMES[1], "messages": ASK, **GREEDY} | body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, **body) -> tuple[str, str, list[dict]]:
    body = {"model": NAMES[0], "messages": ASK, "stream": True, **GREEDY} | body
    reasoning, content, chunks = "", "", []
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                chunks.append(chunk)
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    assert delta.get("reasoning") == delta.get("reasoning_content")
                    reasoning += delta.get("reasoning") or ""
                    content += delta.get("content") or ""
    return reasoning, content, chunks


def test_the_budget_closes_the_block_and_the_split_is_the_raw_output(stack):
    stub, http, tokenizer = stack
    prompt = _prompt(tokenizer)
    end = tokenizer.convert_tokens_to_ids("</think>")
    ids, reasoning, content, usage = _grpc(
        stub,
        messages=_messages(ASK),
        max_new_tokens=MAX_TOKENS,
        sampling=pb.SamplingParams(temperature=0.0),
        thinking_token_budget=BUDGET,
        ignore_eos=True,
    )
    # The block opened in the prompt; BUDGET tokens of reasoning, then the end tag, forced.
    assert len(ids) == MAX_TOKENS and ids[BUDGET] == end and end not in ids[:BUDGET]
    assert usage.reasoning_tokens == BUDGET and usage.completion_tokens == MAX_TOKENS
    assert tokenizer.decode(ids, skip_special_tokens=True) == reasoning + "</think>" + content
    assert reasoning and content
    # Nothing else changed: the reasoning is the plain greedy continuation of the prompt, the content that of
    # the prompt with the closed block (token-id prompts: no parser, no budget).
    plain = dict(max_new_tokens=BUDGET, sampling=pb.SamplingParams(temperature=0.0), ignore_eos=True)
    assert _grpc(stub, token_ids=prompt, **plain)[0] == ids[:BUDGET]
    rest = dict(plain, max_new_tokens=MAX_TOKENS - BUDGET - 1)
    after, no_reasoning, after_text, _ = _grpc(stub, token_ids=prompt + ids[: BUDGET + 1], **rest)
    assert after == ids[BUDGET + 1 :] and no_reasoning == ""

    # The same through HTTP, whole and streamed.
    body = dict(max_tokens=MAX_TOKENS, thinking_token_budget=BUDGET, ignore_eos=True)
    answer = _chat(http, **body)
    message = answer["choices"][0]["message"]
    assert answer["model"] == NAMES[0]  # asked as the second name, answered as the first
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (
        reasoning,
        reasoning,
        content,
    )
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": BUDGET}
    # n choices: each split alike, their reasoning tokens summed.
    two = _chat(http, **body, n=2)
    assert [c["message"]["reasoning"] for c in two["choices"]] == [reasoning] * 2
    assert two["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * BUDGET}
    streamed_reasoning, streamed_content, chunks = _stream(
        http, **body, stream_options={"include_usage": True}
    )
    assert (streamed_reasoning, streamed_content) == (reasoning, content)
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": BUDGET}
    # include_reasoning false: the same content, no reasoning.
    hidden = _chat(http, **body, include_reasoning=False)["choices"][0]["message"]
    assert (hidden["reasoning"], hidden["content"]) == (None, content)
    assert _stream(http, **body, include_reasoning=False)[:2] == ("", content)


def test_without_a_budget_a_block_never_closed_is_all_reasoning(stack):
    stub, http, tokenizer = stack
    ids, reasoning, content, usage = _grpc(
        stub, messages=_messages(ASK), max_new_tokens=8, sampling=pb.SamplingParams(temperature=0.0)
    )
    assert "</think>" not in tokenizer.decode(
        ids, skip_special_tokens=True
    )  # a random model does not close it (else: a new seed)
    assert (reasoning, content, usage.reasoning_tokens) == (
        tokenizer.decode(ids, skip_special_tokens=True),
        "",
        len(ids),
    )
    message = _chat(http, max_tokens=8)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (reasoning, None)


def test_template_kwargs_and_reasoning_effort_reach_the_template(stack):
    stub, http, tokenizer = stack
    # enable_thinking false: the template closes an empty block in the prompt, so it is all content.
    off = _chat(http, max_tokens=8, ignore_eos=True, chat_template_kwargs={"enable_thinking": False})
    prompt = _prompt(tokenizer, enable_thinking=False)
    raw = _grpc(stub, token_ids=prompt, max_new_tokens=8, sampling=pb.SamplingParams(temperature=0.0))
    message = off["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, raw[2])
    assert off["usage"]["prompt_tokens"] == len(prompt)
    assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    effort = _chat(http, max_tokens=1, reasoning_effort="high")["usage"]["prompt_tokens"]
    with_effort = _prompt(tokenizer, reasoning_effort="high")
    assert effort == len(with_effort) > len(_prompt(tokenizer))
    r = http.post(
        "/v1/chat/completions",
        json={"messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_tool_call_and_a_schema_start_after_the_think_block(stack, tool_choice):
    stub, http, tokenizer = stack
    # One call (a random model would add calls to a "required" array until max_tokens).
    body = dict(
        max_tokens=60,
        thinking_token_budget=BUDGET,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
    )
    answer = _chat(http, **body)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": BUDGET}
    assert choice["message"]["reasoning"]
    streamed = _stream(http, **body)[2]
    calls = [c for chunk in streamed for ch in chunk["choices"] for c in ch["delta"].get("tool_calls", [])]
    assert [c["function"] for c in calls] == [call["function"]]
    # A JSON schema (response_format) holds the content only.
    schema = WEATHER["function"]["parameters"]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    message = _chat(http, max_tokens=60, thinking_token_budget=BUDGET, response_format=fmt)["choices"][0]
    jsonschema.validate(json.loads(message["message"]["content"]), schema)
    assert message["finish_reason"] == "stop"


def test_served_model_names(stack):
    _, http, _ = stack
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [NAMES[0]]
    assert http.get(f"/v1/models/{NAMES[1]}").json()["id"] == NAMES[0]
    r = http.post("/v1/chat/completions", json={"model": "other", "messages": ASK, "max_tokens": 1})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["param"] == "model" and "other" in error["message"]


def test_anthropic_thinking_blocks_and_responses_reasoning_items(stack):
    """The same split through the agent APIs (router/anthropic/, router/openai/responses*.py), each SDK's own
    client: thinking enabled with budget_tokens is the chat request with enable_thinking and
    thinking_token_budget; the thinking block and the reasoning item hold the chat answer's reasoning."""
    import anthropic
    import openai

    _, http, _ = stack
    url = str(http.base_url).rstrip("/")
    expected = _chat(http, max_tokens=MAX_TOKENS, thinking_token_budget=BUDGET)
    message = expected["choices"][0]["message"]
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    kw = dict(
        model=NAMES[1],
        max_tokens=MAX_TOKENS,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body=GREEDY,
    )
    whole = claude.messages.create(**kw)
    thinking = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content]
    assert thinking[0] == ("thinking", message["reasoning"])
    assert "".join(t for kind, t in thinking if kind == "text") == (message["content"] or "")
    with claude.messages.stream(**kw) as events:
        streamed = [b.model_dump(exclude={"parsed_output"}) for b in events.get_final_message().content]
    assert streamed == [b.model_dump() for b in whole.content]

    o = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    # No budget on this API: the block a random model never closes is all reasoning.
    rkw = dict(model=NAMES[0], input=ASK, max_output_tokens=8, temperature=0, reasoning={"effort": "low"})
    r = o.responses.create(**rkw)
    assert [i.type for i in r.output] == ["reasoning"] and r.status == "incomplete"
    effort = _chat(http, max_tokens=8, reasoning_effort="low")["choices"][0]["message"]
    assert r.output[0].content[0].text == effort["reasoning"] and effort["reasoning"]
    assert r.usage.output_tokens_details.reasoning_tokens == 8
    with o.responses.stream(**rkw) as events:
        last = list(events)[-1]  # an incomplete answer ends with response.incomplete, not .completed
    assert last.type == "response.incomplete"
    assert [i.model_dump(exclude={"id"}) for i in last.response.output] == [
        i.model_dump(exclude={"id"}) for i in r.output
    ]
