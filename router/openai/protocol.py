"""/v1/completions and /v1/chat/completions bodies, translated to tpserve.v1 GenerateRequests. Plain functions
over dicts: no HTTP here (server.py serves them), so every translation is tested in microseconds.

A body becomes a GenerateRequest and nothing more: validation, limits and defaults are the Frontend's, as for
gRPC. What is checked here is what a GenerateRequest cannot carry: JSON types, the fields tpserve does not
implement (fields.py), and the tool choice. A RequestFailed from the Frontend comes back as an ApiError in
one place (errors.from_failure), its field renamed to the name the client used (`params`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.sampling import SAMPLING_FIELDS
from router.openai import fields as f
from router.openai.errors import bad_request
from router.openai.tools import ToolChoice, parse_tool_calls, parse_tool_choice, parse_tools
from router.validation import max_new_tokens_too_small

# The default of OpenAI's legacy completions endpoint (chat leaves it to the server: as much as fits).
COMPLETIONS_MAX_TOKENS = 16


@dataclass(frozen=True)
class ApiRequest:
    """A decoded /v1/completions or /v1/chat/completions body."""

    chat: bool
    generate: pb.GenerateRequest
    model: str | None  # None: the served model
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices
    logprobs: int | None  # alternatives to return per token (None: no logprobs at all)
    params: dict[str, str]  # GenerateRequest field -> this request's name for it (for errors)
    tool_choice: ToolChoice | None = None  # chat only


def _max_tokens(body: dict, name: str) -> int | None:
    """One message for every value below 1, whatever the API (-1 and 0 alike)."""
    value = f.integer(body, name, -(2**63), 2**63 - 1)
    if value is not None and value < 1:
        raise bad_request(name, max_new_tokens_too_small(value, name))
    if value is not None and value > f.UINT32_MAX:
        raise bad_request(name, f"{name} must be at most {f.UINT32_MAX}, got {value}")
    return value


def _common(body: object, request_id: str, chat: bool) -> tuple[dict, dict]:
    """The fields both endpoints share -> (GenerateRequest keyword arguments, the rest of ApiRequest)."""
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {f.kind(body)}")
    f.check_fields(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", f"model must be a string, got {f.kind(model)}")
    stream = f.boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict):
            raise bad_request("stream_options", f"stream_options must be an object, got {f.kind(options)}")
    include_usage = f.boolean(options or {}, "include_usage")
    given_id = body.get("request_id")
    if given_id is not None and not isinstance(given_id, str):
        raise bad_request("request_id", f"request_id must be a string, got {f.kind(given_id)}")

    sampling = {}
    for name in SAMPLING_FIELDS:
        if name == "top_k":  # vLLM's extension; -1 (its "no cut") is our 0
            value = f.integer(body, name, -1, 2**31 - 1)
            value = 0 if value == -1 else value
        elif name == "seed":
            value = f.integer(body, name, 0, 2**64 - 1)
        else:
            value = f.number(body, name)
        if value is not None:
            sampling[name] = value
    min_tokens = f.integer(body, "min_tokens", 0, f.UINT32_MAX)
    if min_tokens is not None:
        sampling["min_tokens"] = min_tokens
    kwargs = dict(
        request_id=given_id or request_id,
        sampling=pb.SamplingParams(
            **sampling, logit_bias=f.logit_bias(body), bad_words=f.strings(body, "bad_words", single=False)
        ),
        stop=f.strings(body, "stop"),
        # vLLM's extensions, for clients that send them (extra_body in the openai client).
        stop_token_ids=f.token_ids(body, "stop_token_ids"),
        ignore_eos=f.boolean(body, "ignore_eos"),
        include_stop_str_in_output=f.boolean(body, "include_stop_str_in_output"),
    )
    for name in ("skip_special_tokens", "add_special_tokens"):
        if body.get(name) is not None:
            kwargs[name] = f.boolean(body, name)
    params = {
        f"sampling.{name}": name for name in (*SAMPLING_FIELDS, "logit_bias", "min_tokens", "bad_words")
    }
    params |= {
        "request_id": "request_id" if given_id else "X-Request-Id",
        "text": "prompt",
        "token_ids": "prompt",
    }
    return kwargs, dict(params=params, model=model, stream=stream, include_usage=include_usage)


def parse_completion(body: object, request_id: str) -> ApiRequest:
    """A /v1/completions body. prompt: a string, a list of one string, or token ids (a list of ints, or a
    list of one such list)."""
    kwargs, rest = _common(body, request_id, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        kwargs["text"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        kwargs["token_ids"] = f.token_ids({"prompt": prompt}, "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("prompt", "prompt: one prompt per request (send a request for each)")
    else:
        raise bad_request("prompt", "prompt must be a string or an array of token ids")
    max_tokens = _max_tokens(body, "max_tokens")
    kwargs["max_new_tokens"] = COMPLETIONS_MAX_TOKENS if max_tokens is None else max_tokens
    logprobs = f.integer(body, "logprobs", 0, f.UINT32_MAX)
    if logprobs is not None:
        # The proto's 0 means "no logprobs": the chosen token's own needs at least one alternative asked.
        kwargs["top_logprobs"] = max(logprobs, 1)
    rest["params"] |= {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}
    return ApiRequest(chat=False, generate=pb.GenerateRequest(**kwargs), logprobs=logprobs, **rest)


def _content(message: dict, where: str) -> str:
    """A message's content: a string, or text parts [{"type": "text", "text": ...}] joined by newlines."""
    content = message.get("content")
    if content is None:
        return ""  # an assistant turn that only called tools
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(f"{where}.content", "only text content parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where}.content", "content must be a string or an array of parts")


def parse_message(m: object, where: str) -> pb.ChatMessage:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(where, f"{where} must be an object with a string role")
    for name in ("name", "tool_call_id"):
        if m.get(name) is not None and not isinstance(m[name], str):
            raise bad_request(f"{where}.{name}", f"{where}.{name} must be a string")
    return pb.ChatMessage(
        role="system" if m["role"] == "developer" else m["role"],  # OpenAI's newer name for it
        content=_content(m, where),
        tool_calls=parse_tool_calls(m, where),
        tool_call_id=m.get("tool_call_id") or "",
        name=m.get("name") or "",
    )


def parse_chat(body: object, request_id: str, tool_parser: str | None = None) -> ApiRequest:
    """A /v1/chat/completions body. tool_parser: the server's --tool-call-parser (tool_choice "auto" needs
    one)."""
    kwargs, rest = _common(body, request_id, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty array of {role, content}")
    kwargs["messages"] = [parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    kwargs["tools"] = parse_tools(body)
    tool_choice = parse_tool_choice(body, kwargs["tools"], tool_parser)
    if body.get("add_generation_prompt") is not None:
        kwargs["add_generation_prompt"] = f.boolean(body, "add_generation_prompt")
    kwargs["continue_final_message"] = f.boolean(body, "continue_final_message")
    # max_completion_tokens is the current name, max_tokens the deprecated one; unset: as much as fits.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, name)
    if max_tokens is not None:
        kwargs["max_new_tokens"] = max_tokens
    want_logprobs = f.boolean(body, "logprobs")
    top = f.integer(body, "top_logprobs", 0, f.UINT32_MAX)
    if top is not None and top > 0 and not want_logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (top or 0) if want_logprobs else None
    if logprobs is not None:
        kwargs["top_logprobs"] = max(logprobs, 1)
    rest["params"] |= {"max_new_tokens": name, "top_logprobs": "top_logprobs"}
    return ApiRequest(
        chat=True,
        generate=pb.GenerateRequest(**kwargs),
        logprobs=logprobs,
        tool_choice=tool_choice,
        **rest,
    )
