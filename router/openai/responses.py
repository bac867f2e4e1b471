"""OpenAI Responses bodies (POST /v1/responses) as the chat completions body that says the same thing, read by
protocol.py's parse_chat into the one internal request. Plain functions over dicts: no HTTP here.

What maps: input (a string: one user message; or items: messages with input_text / output_text parts,
function_call items -> an assistant's tool_calls, function_call_output items -> tool messages; reasoning
items dropped, as chat templates drop past reasoning) after the stored conversation of
previous_response_id; instructions -> a system message first (this request's only: a previous response's
instructions are not carried over, as OpenAI documents); function tools -> chat tools (`strict`, which
OpenAI's clients set by default, is enforced whenever tool_choice forces a call, as in chat); tool_choice
and parallel_tool_calls as they are; text.format -> response_format; reasoning.effort -> reasoning_effort;
max_output_tokens -> max_completion_tokens; temperature, top_p as they are. Images and files are refused:
no vision model is served.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from router.openai import protocol
from router.openai.errors import ApiError, bad_request
from router.openai.fields import kind

# Fields read; ACCEPTED change nothing in the answer; REFUSED_UNLESS: accepted only with these values.
FIELDS = (
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
)
ACCEPTED = ("metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "include")
REFUSED_UNLESS = {
    "background": (False,),  # no background responses: every response is answered while it runs
    "truncation": ("disabled",),  # a conversation too long is refused, not cut
    "top_logprobs": (0,),
    "stream_options": ({},),
}
RENAMES = {
    r"\bmax_completion_tokens\b": "max_output_tokens",
    r"\bresponse_format\b": "text.format",
    r"\b(tools\[\d+\])\.function\b": r"\1",
}


@dataclass(frozen=True)
class ResponsesRequest:
    req: protocol.ApiRequest
    conversation: list[dict]  # the chat messages so far without instructions: what a later turn continues
    echo: dict  # the request's own settings, which the response object repeats


def renamed(e: ApiError) -> ApiError:
    """An error raised in chat terms, in the names this request used."""
    for old, new in RENAMES.items():
        e.message = re.sub(old, new, e.message)
        e.param = re.sub(old, new, e.param) if e.param else e.param
    return e


def parse_responses(
    body: object,
    request_id: str,
    history: list[dict],
    tool_parser: str | None = None,
    strict: bool = True,
) -> ResponsesRequest:
    """A /v1/responses body as the internal request. history: the conversation of previous_response_id
    (chat messages; [] for none)."""
    chat, conversation = to_chat(body, history)
    try:
        req = protocol.parse_chat(chat, request_id, tool_parser, strict)
    except ApiError as e:
        raise renamed(e) from None
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ResponsesRequest(req, conversation, echo)


def to_chat(body: object, history: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat completions body, the conversation without instructions)."""
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {kind(body)}")
    for name, value in body.items():
        if name in REFUSED_UNLESS:
            if value is not None and value not in REFUSED_UNLESS[name]:
                raise bad_request(name, f"{name} {value!r} is not supported by tpserve")
        elif name not in FIELDS and name not in ACCEPTED:
            raise bad_request(name, f"unrecognized request field {name!r}")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions", f"instructions must be a string, got {kind(instructions)}")
    conversation = list(history) + input_messages(body.get("input"), history)
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict = {"model": body.get("model"), "messages": system + conversation}
    for ours, theirs in (
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", None),
        ("top_p", None),
    ):
        if body.get(ours) is not None:
            chat[theirs or ours] = body[ours]
    for name in ("stream", "parallel_tool_calls"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    _text(body.get("text"), chat)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_request("reasoning", f"reasoning must be an object, got {kind(reasoning)}")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat, conversation


def input_messages(value, history: list[dict]) -> list[dict]:
    """input as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or (not value and not history):
        raise bad_request("input", "input must be a string or a non-empty array of items")
    out: list[dict] = []
    names = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or ()}
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(where, f"{where} must be an object, got {kind(item)}")
        kind_ = item.get("type", "message")
        if kind_ == "message":
            out.append(_message(item, where))
        elif kind_ == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of one turn, together
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind_ == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id", f"{where}.call_id must be a string")
            if isinstance(output, list):
                output = "\n".join(p["text"] for p in _parts(output, f"{where}.output"))
            if not isinstance(output, str):
                raise bad_request(f"{where}.output", f"{where}.output must be a string")
            tool = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in names:
                tool["name"] = names[call_id]
            out.append(tool)
        elif kind_ == "reasoning":
            continue  # past reasoning: templates leave it out
        else:
            raise bad_request(
                f"{where}.type",
                f"{where}.type {kind_!r}: tpserve reads message, function_call, function_call_output and "
                "reasoning items",
            )
    return out


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(
            f"{where}.role", f'{where}.role must be "user", "assistant", "system" or "developer"'
        )
    content = item.get("content")
    if isinstance(content, list):
        content = _parts(content, f"{where}.content")
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content", f"{where}.content must be a string or an array of parts")
    return {"role": role, "content": content}


def _parts(parts: list, where: str) -> list[dict]:
    out = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind_ = part.get("type") if isinstance(part, dict) else None
        if kind_ in ("input_image", "input_file", "input_audio"):
            raise bad_request(
                f"{at}.type", f"{at}: {kind_} is not supported: this server serves no vision model"
            )
        if kind_ not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(at, f'{at} must be {{"type": "input_text", "text": ...}}')
        out.append({"type": "text", "text": part["text"]})
    return out


def _function_call(item: dict, where: str) -> dict:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise bad_request(where, f"{where}: a function_call needs string call_id, name and arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("tools", f"tools must be an array, got {kind(tools)}")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f"{where}.type", f"{where}: only function tools are served (no tool runs on the server)"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice", 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}'
    )


def _text(text, chat: dict) -> None:
    if text is None:
        return
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise bad_request("text", 'text must be {"format": {"type": ...}}')
    if fmt is None or fmt.get("type") == "text":
        return
    if fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    else:
        raise bad_request(
            "text.format.type", 'text.format.type must be "text", "json_object" or "json_schema"'
        )
