"""OpenAI's request and response shapes, translated to and from tpserve.v1 messages. Plain functions over
dicts: no HTTP here (router/openai_api.py serves them), so every translation is tested in microseconds.

A request body becomes a GenerateRequest and nothing more: validation, limits and defaults are the
Frontend's, as for gRPC. What is checked here is only what a GenerateRequest cannot carry: JSON types,
OpenAI fields tpserve does not implement (n > 1, echo, tools, ...) and the model's name. A RequestFailed
from the Frontend comes back as an ApiError in one place (`from_failure`), its field renamed to the name
the client used (sampling.temperature -> temperature, max_new_tokens -> max_tokens, text -> prompt).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from common.client import Completion
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.sampling import SAMPLING_FIELDS
from router.frontend import RequestFailed

# The gRPC status a failure has on the gRPC API -> the HTTP status it has here.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

FINISH_REASONS = {
    pb.FINISH_REASON_EOS: "stop",  # OpenAI does not tell EOS from a stop sequence
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "abort",  # vLLM's name: the server ended it (shutting down)
}

# What JSON cannot hold (a logprob of -inf) is sent as OpenAI and vLLM send it.
MIN_LOGPROB = -9999.0
# The default of OpenAI's legacy completions endpoint (chat leaves it to the server: as much as fits).
COMPLETIONS_MAX_TOKENS = 16
UINT32_MAX = 2**32 - 1


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """An error answer: HTTP `status` and OpenAI's body {"error": {"message", "type", "param", "code"}}.
    code is the gRPC status name the same failure has on the gRPC API (INVALID_ARGUMENT, ...)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code=grpc.StatusCode.INVALID_ARGUMENT.name)


def from_failure(e: RequestFailed, params: dict[str, str]) -> ApiError:
    """The one mapping of a Frontend failure to an HTTP error. params: GenerateRequest field -> the name the
    client's request used for it; the field and its mentions in the message are renamed."""
    param, message = None, e.message
    if e.field:
        base = re.match(r"[A-Za-z_.]*", e.field).group()
        name = params.get(base, base)
        param = name + e.field[len(base) :]  # token_ids[3] -> prompt[3]
        if name != base:
            message = re.sub(rf"(?<![\w.]){re.escape(base)}(?![\w])", name, message)
    return ApiError(HTTP_STATUS.get(e.code, 500), message, param=param, code=e.code.name)


# ---- requests ----


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


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(name, f"{name} must be a number, got {_kind(value)}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    """An integer that fits the proto field: the Frontend checks what it means, this only that it can
    travel (a negative max_tokens cannot be a uint32)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"{name} must be an integer, got {_kind(value)}")
    if not low <= value <= high:
        raise bad_request(name, f"{name} must be in [{low}, {high}], got {value}")
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"{name} must be a boolean, got {_kind(value)}")
    return value


def _strings(body: dict, name: str) -> list[str]:
    """A string or a list of strings (stop)."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise bad_request(name, f"{name} must be a string or an array of strings, got {_kind(value)}")


def _token_ids(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(not 0 <= t <= UINT32_MAX for t in value):
            raise bad_request(name, f"{name} must hold token ids >= 0")
        return value
    raise bad_request(name, f"{name} must be an array of token ids")


# OpenAI fields tpserve does not implement, with the values that mean "not used". Any other value is
# refused rather than ignored: ignoring it would silently answer a different question.
UNSUPPORTED = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


def _check_unsupported(body: dict) -> None:
    for name, unused in UNSUPPORTED.items():
        if name in body and body[name] not in unused:
            if name == "n":
                message = "n must be 1: tpserve returns one choice per request (send n requests instead)"
            else:
                message = f"{name} is not supported by tpserve"
            raise bad_request(name, message)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request("response_format", 'response_format: only {"type": "text"} is supported')


def _common(body: object) -> tuple[dict, dict]:
    """The fields both endpoints share -> (GenerateRequest keyword arguments, their params for errors)."""
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {_kind(body)}")
    _check_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", f"model must be a string, got {_kind(model)}")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict):
            raise bad_request("stream_options", f"stream_options must be an object, got {_kind(options)}")
    include_usage = _bool(options or {}, "include_usage")

    sampling = {}
    for name in SAMPLING_FIELDS:
        if name == "top_k":  # vLLM's extension; -1 (its "no cut") is our 0
            value = _integer(body, name, -1, 2**31 - 1)
            value = 0 if value == -1 else value
        elif name == "seed":
            value = _integer(body, name, 0, 2**64 - 1)
        else:
            value = _number(body, name)
        if value is not None:
            sampling[name] = value
    kwargs = dict(
        sampling=pb.SamplingParams(**sampling),
        stop=_strings(body, "stop"),
        # vLLM's extensions, for clients that send them (extra_body in the openai client).
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
    )
    params = {f"sampling.{name}": name for name in SAMPLING_FIELDS}
    params |= {"request_id": "X-Request-Id", "text": "prompt", "token_ids": "prompt"}
    return kwargs, dict(params=params, model=model, stream=stream, include_usage=include_usage)


def parse_completion(body: object, request_id: str) -> ApiRequest:
    """A /v1/completions body. prompt: a string, a list of one string, or token ids (a list of ints, or a
    list of one such list)."""
    kwargs, rest = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        kwargs["text"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        kwargs["token_ids"] = _token_ids({"prompt": prompt}, "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("prompt", "prompt: one prompt per request (send a request for each)")
    else:
        raise bad_request("prompt", "prompt must be a string or an array of token ids")
    max_tokens = _integer(body, "max_tokens", 0, UINT32_MAX)
    kwargs["max_new_tokens"] = COMPLETIONS_MAX_TOKENS if max_tokens is None else max_tokens
    logprobs = _integer(body, "logprobs", 0, UINT32_MAX)
    if logprobs is not None:
        # The proto's 0 means "no logprobs": the chosen token's own needs at least one alternative asked.
        kwargs["top_logprobs"] = max(logprobs, 1)
    rest["params"] |= {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}
    return ApiRequest(
        chat=False, generate=pb.GenerateRequest(request_id=request_id, **kwargs), logprobs=logprobs, **rest
    )


def _content(message: dict, i: int) -> str:
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
                raise bad_request(f"messages[{i}].content", "only text content parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content", "content must be a string or an array of parts")


def parse_chat(body: object, request_id: str) -> ApiRequest:
    """A /v1/chat/completions body."""
    kwargs, rest = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty array of {role, content}")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}]", f"messages[{i}] must be an object with a string role")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for it
        chat.append(pb.ChatMessage(role=role, content=_content(m, i)))
    kwargs["messages"] = chat
    # max_completion_tokens is the current name, max_tokens the deprecated one; unset: as much as fits.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, 0, UINT32_MAX)
    if max_tokens is not None:
        kwargs["max_new_tokens"] = max_tokens
    want_logprobs = _bool(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, UINT32_MAX)
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (top or 0) if want_logprobs else None
    if logprobs is not None:
        kwargs["top_logprobs"] = max(logprobs, 1)
    rest["params"] |= {"max_new_tokens": name, "top_logprobs": "top_logprobs"}
    return ApiRequest(
        chat=True, generate=pb.GenerateRequest(request_id=request_id, **kwargs), logprobs=logprobs, **rest
    )


# ---- responses ----


def usage(u: pb.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _logprob(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _chat_logprob(t: pb.TokenLogprob) -> dict:
    # bytes: the token text's UTF-8 (a token ending inside a character has U+FFFD there, not its byte)
    return {"token": t.text, "logprob": _logprob(t.logprob), "bytes": list(t.text.encode())}


class Encoder:
    """Turns one request's GenerateResponses into OpenAI's objects: stream chunks, or the whole answer."""

    def __init__(self, req: ApiRequest, model: str, created: int | None = None):
        self.req = req
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + req.generate.request_id
        self._text_offset = 0  # completions' logprobs.text_offset, across chunks

    def _object(self, kind: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, lps: Iterable[pb.Logprobs]) -> dict | None:
        k, lps = self.req.logprobs, list(lps)
        if k is None:
            return None
        if self.req.chat:
            return {
                "content": [
                    _chat_logprob(lp.chosen) | {"top_logprobs": [_chat_logprob(t) for t in lp.top[:k]]}
                    for lp in lps
                ]
            }
        offsets = []
        for lp in lps:
            offsets.append(self._text_offset)
            self._text_offset += len(lp.chosen.text)
        return {
            "tokens": [lp.chosen.text for lp in lps],
            "token_logprobs": [_logprob(lp.chosen.logprob) for lp in lps],
            "top_logprobs": [{t.text: _logprob(t.logprob) for t in lp.top[:k]} for lp in lps],
            "text_offset": offsets,
        }

    # -- streaming --

    def role_chunk(self) -> dict:
        """A chat stream's first chunk: who speaks."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def chunk(self, resp: pb.GenerateResponse) -> dict | None:
        """The chunk for one response; None when it has nothing to say (text held back, no logprobs)."""
        if not resp.text and not resp.finish_reason and not (resp.logprobs and self.req.logprobs is not None):
            return None
        finish = FINISH_REASONS.get(resp.finish_reason)
        logprobs = self._logprobs(resp.logprobs)
        if self.req.chat:
            delta = {"content": resp.text} if resp.text else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": resp.text, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([choice])

    def usage_chunk(self, u: pb.Usage) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return self._chunk([]) | {"usage": usage(u)}

    def _chunk(self, choices: list) -> dict:
        out = self._object("chat.completion.chunk" if self.req.chat else "text_completion", choices)
        if self.req.include_usage:
            out["usage"] = None  # as OpenAI: every chunk but the last has a null usage
        return out

    # -- the whole answer --

    def whole(self, responses: Iterable[pb.GenerateResponse]) -> dict:
        done = Completion()
        for resp in responses:
            done.add(resp)
        finish = FINISH_REASONS.get(done.finish_reason)
        logprobs = self._logprobs(done.logprobs)
        if self.req.chat:
            message = {"role": "assistant", "content": done.text}
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            out = self._object("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": done.text, "logprobs": logprobs, "finish_reason": finish}
            out = self._object("text_completion", [choice])
        return out | {"usage": usage(done.usage or pb.Usage())}
