"""/v1/completions and /v1/chat/completions bodies, translated to tpserve.v1 GenerateRequests. Plain functions
over dicts: no HTTP here (server.py serves them), so every translation is tested in microseconds.

A body becomes a GenerateRequest and nothing more: validation, limits and defaults are the Frontend's, as for
gRPC. What is checked here is what a GenerateRequest cannot carry: JSON types, the fields tpserve does not
implement (fields.py), and the tool choice. A RequestFailed from the Frontend comes back as an ApiError in
one place (errors.from_failure), its field renamed to the name the client used (`params`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.grammar import KINDS as STRUCTURED_KINDS
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.sampling import SAMPLING_FIELDS
from router.choices import MAX_N
from router.openai import fields as f
from router.openai.errors import bad_request
from router.openai.structured import parse_structured
from router.openai.tools import ToolChoice, output_schema, parse_tool_calls, parse_tool_choice, parse_tools
from router.validation import max_new_tokens_too_small

# Prompts in one /v1/completions request: each is a request of its own (with its n choices).
MAX_PROMPTS = 64
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
    # /v1/completions with a list of prompts: the GenerateRequests of the prompts after the first.
    more: tuple[pb.GenerateRequest, ...] = ()
    n: int = 1  # choices returned per prompt
    best_of: int | None = None  # choices generated per prompt, the n best kept (completions)
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's: alternatives per prompt position

    @property
    def generates(self) -> tuple[pb.GenerateRequest, ...]:
        return (self.generate, *self.more)

    @property
    def num_choices(self) -> int:
        return self.n * len(self.generates)


def _max_tokens(body: dict, name: str) -> int | None:
    """One message for every value below 1, whatever the API (-1 and 0 alike)."""
    value = f.integer(body, name, -(2**63), 2**63 - 1)
    if value is not None and value < 1:
        raise bad_request(name, max_new_tokens_too_small(value, name))
    if value is not None and value > f.UINT32_MAX:
        raise bad_request(name, f"{name} must be at most {f.UINT32_MAX}, got {value}")
    return value


def _common(body: object, request_id: str, chat: bool, strict: bool) -> tuple[dict, dict]:
    """The fields both endpoints share -> (GenerateRequest keyword arguments, the rest of ApiRequest).
    strict: the server's disable_additional_properties (JSON Schemas closed, structured.py)."""
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
    structured, structured_field = parse_structured(body, strict)
    kwargs = dict(
        request_id=given_id or request_id,
        sampling=pb.SamplingParams(
            **sampling,
            logit_bias=f.logit_bias(body),
            bad_words=f.strings(body, "bad_words", single=False),
            structured_output=structured,
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
    for name in ("ttft_objective_ms", "tpot_objective_ms"):  # latency objectives (router/slo.py)
        if (value := f.integer(body, name, 0, f.UINT32_MAX)) is not None:
            kwargs[name] = value
    if (priority := f.integer(body, "priority", -(2**31), 2**31 - 1)) is not None:
        kwargs["priority"] = priority
    n = f.integer(body, "n", 1, MAX_N)
    prompt_logprobs = f.integer(body, "prompt_logprobs", 0, f.UINT32_MAX)
    if prompt_logprobs is not None and stream and chat:
        raise bad_request("prompt_logprobs", "prompt_logprobs is not supported with stream on chat (as vLLM)")
    if n is not None:
        kwargs["n"] = n
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    params = {
        f"sampling.{name}": name for name in (*SAMPLING_FIELDS, "logit_bias", "min_tokens", "bad_words")
    }
    if structured_field is not None:
        # The oneof's members first: a message naming one is renamed whole, not by its prefix.
        params |= {f"sampling.structured_output.{k}": structured_field for k in STRUCTURED_KINDS}
        params |= {"sampling.structured_output": structured_field}
    params |= {
        "request_id": "request_id" if given_id else "X-Request-Id",
        "text": "prompt",
        "token_ids": "prompt",
    }
    rest = dict(params=params, model=model, stream=stream, include_usage=include_usage)
    return kwargs, rest | dict(n=n or 1, echo=f.boolean(body, "echo"), prompt_logprobs=prompt_logprobs)


def parse_completion(body: object, request_id: str, strict: bool = True) -> ApiRequest:
    """A /v1/completions body. prompt: a string, token ids (a list of ints), or a list of several of
    either: one GenerateRequest per prompt (the first keeps the request id, prompt p gets "id/p"), whose
    choices come prompt after prompt (index p * n + i)."""
    kwargs, rest = _common(body, request_id, chat=False, strict=strict)
    prompts = _prompts(body.get("prompt"))
    max_tokens = _max_tokens(body, "max_tokens")
    kwargs["max_new_tokens"] = COMPLETIONS_MAX_TOKENS if max_tokens is None else max_tokens
    logprobs = f.integer(body, "logprobs", 0, f.UINT32_MAX)
    if logprobs is not None:
        # The proto's 0 means "no logprobs": the chosen token's own needs at least one alternative asked.
        kwargs["top_logprobs"] = max(logprobs, 1)
    best_of = f.integer(body, "best_of", 1, MAX_N)
    if best_of is not None:
        if best_of < rest["n"]:
            raise bad_request("best_of", f"best_of ({best_of}) must be at least n ({rest['n']})")
        if rest["stream"] and best_of > rest["n"]:
            raise bad_request("best_of", "best_of cannot be used with stream: the best are known at the end")
        # Generated: best_of choices, ranked by their tokens' summed logprob (each token's is needed).
        kwargs["n"] = best_of
        kwargs["top_logprobs"] = max(kwargs.get("top_logprobs", 0), 1)
    if rest["echo"] and logprobs is not None and rest["prompt_logprobs"] is None:
        kwargs["prompt_logprobs"] = logprobs  # echo with logprobs: the prompt's come first
    rest["params"] |= {
        "max_new_tokens": "max_tokens",
        "top_logprobs": "logprobs",
        "n": "best_of" if best_of else "n",
    }
    generates = []
    for p, prompt in enumerate(prompts):
        g = pb.GenerateRequest(**kwargs)
        if p:
            g.request_id = f"{g.request_id}/{p}"
        if isinstance(prompt, str):
            g.text = prompt
        else:
            g.token_ids.extend(prompt)
        generates.append(g)
    return ApiRequest(
        chat=False,
        generate=generates[0],
        more=tuple(generates[1:]),
        logprobs=logprobs,
        best_of=best_of,
        **rest,
    )


def _prompts(prompt) -> list[str | list[int]]:
    """The prompts of a completions body: a string, token ids, or a list of several of either."""
    if isinstance(prompt, str):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return [f.token_ids({"prompt": prompt}, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(
                "prompt", f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}"
            )
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, list):
                if not p:
                    raise bad_request(f"prompt[{i}]", f"prompt[{i}] is empty")
                p = f.token_ids({f"prompt[{i}]": p}, f"prompt[{i}]")
            out.append(p)
        return out
    raise bad_request("prompt", "prompt must be a string, an array of token ids, or an array of either")


def _content(message: dict, where: str) -> tuple[str, list[pb.ContentPart]]:
    """A message's content: a string, or parts. Text parts alone are joined by newlines into content; with
    an image_url part among them, the parts travel in order (ChatMessage.parts) and content stays empty."""
    content = message.get("content")
    if content is None:
        return "", []  # an assistant turn that only called tools
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content", "content must be a string or an array of parts")
    parts = [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
    if all(p.WhichOneof("kind") == "text" for p in parts):
        return "\n".join(p.text for p in parts), []
    return "", parts


def _part(part: object, where: str) -> pb.ContentPart:
    """{"type": "text", "text"} or OpenAI's {"type": "image_url", "image_url": {"url"} or "url"}."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return pb.ContentPart(text=part["text"])
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}.image_url", f"{where}.image_url must be {{'url': string}}")
        return pb.ContentPart(image=pb.Image(url=url))
    raise bad_request(where, f"{where}: content parts are text or image_url")


def parse_message(m: object, where: str) -> pb.ChatMessage:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(where, f"{where} must be an object with a string role")
    for name in ("name", "tool_call_id"):
        if m.get(name) is not None and not isinstance(m[name], str):
            raise bad_request(f"{where}.{name}", f"{where}.{name} must be a string")
    content, parts = _content(m, where)
    return pb.ChatMessage(
        role="system" if m["role"] == "developer" else m["role"],  # OpenAI's newer name for it
        content=content,
        parts=parts,
        tool_calls=parse_tool_calls(m, where),
        tool_call_id=m.get("tool_call_id") or "",
        name=m.get("name") or "",
    )


def _reasoning_fields(body: dict, kwargs: dict) -> None:
    """chat_template_kwargs, reasoning_effort, include_reasoning, thinking_token_budget."""
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None:
        if not isinstance(template_kwargs, dict):
            raise bad_request(
                "chat_template_kwargs",
                f"chat_template_kwargs must be an object, got {f.kind(template_kwargs)}",
            )
        kwargs["chat_template_kwargs_json"] = json.dumps(template_kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise bad_request("reasoning_effort", f"reasoning_effort must be a string, got {f.kind(effort)}")
        kwargs["reasoning_effort"] = effort
    if body.get("include_reasoning") is not None:
        kwargs["include_reasoning"] = f.boolean(body, "include_reasoning")
    budget = f.integer(body, "thinking_token_budget", 0, f.UINT32_MAX)
    if budget is not None:
        kwargs["thinking_token_budget"] = budget


def parse_chat(
    body: object, request_id: str, tool_parser: str | None = None, strict: bool = True
) -> ApiRequest:
    """A /v1/chat/completions body. tool_parser: the server's --tool-call-parser (tool_choice "auto" needs
    one); strict: the server's disable_additional_properties (schemas and tool parameters closed)."""
    kwargs, rest = _common(body, request_id, chat=True, strict=strict)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty array of {role, content}")
    kwargs["messages"] = [parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    kwargs["tools"] = parse_tools(body)
    tool_choice = parse_tool_choice(body, kwargs["tools"], tool_parser)
    schema = output_schema(kwargs["tools"], tool_choice, strict)
    if schema is not None:
        # "required" or a named function: the answer is the call itself, its arguments held to the
        # function's schema by a grammar.
        if kwargs["sampling"].HasField("structured_output"):
            raise bad_request(
                "tool_choice", "tool_choice forcing a call cannot be combined with response_format"
            )
        kwargs["sampling"].structured_output.json_schema = json.dumps(schema)
        rest["params"] |= {f"sampling.structured_output.{k}": "tool_choice" for k in STRUCTURED_KINDS}
    if body.get("add_generation_prompt") is not None:
        kwargs["add_generation_prompt"] = f.boolean(body, "add_generation_prompt")
    kwargs["continue_final_message"] = f.boolean(body, "continue_final_message")
    _reasoning_fields(body, kwargs)
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
