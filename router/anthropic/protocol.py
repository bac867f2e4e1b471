"""Anthropic Messages bodies (/v1/messages, /v1/messages/count_tokens) as the chat completions body that says
the same thing, read by router/openai/protocol.py's parse_chat into the one internal request. Plain
functions over dicts: no HTTP here.

What maps: system (a string or text blocks) -> a system message; text blocks -> text parts; an assistant's
tool_use blocks -> its tool_calls; a user's tool_result blocks -> tool messages (before the user's own
text, where Anthropic puts them); a last assistant message -> continue_final_message (Anthropic's
prefill); tools (input_schema) -> function tools; tool_choice auto / any / tool / none -> auto / required
/ a named function / none (disable_parallel_tool_use -> parallel_tool_calls false); stop_sequences ->
stop; max_tokens -> max_completion_tokens; temperature, top_p, top_k as they are; output_config.format
json_schema -> response_format. Thinking blocks sent back are dropped (chat templates drop past reasoning).
Images and documents are refused: no vision model is served.
"""

from __future__ import annotations

import json
import re

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.openai import protocol
from router.openai.errors import ApiError, bad_request
from router.openai.fields import kind

# Fields read (MESSAGE_FIELDS) and fields that change nothing in the answer (ACCEPTED); any other is
# refused, as Anthropic's API refuses what it does not know.
MESSAGE_FIELDS = (
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
)
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking")
# Roles outside Anthropic's spec that Claude Code (2.1.154 and later) sends for context turns: user turns.
CLAUDE_CODE_ROLES = {"ctx": "user", "msg": "user"}
# Claude Code's first system block: a per-request attribution hash, which would make every prompt's prefix
# differ (no prefix cache hit); it says nothing to the model.
BILLING_HEADER = "x-anthropic-billing-header"
ACCEPTED = ("metadata", "service_tier", "cache_control")  # cache_control: prefix caching needs no hint
# Anthropic's names for the chat fields they map to, for error messages (OpenAI's name -> Anthropic's).
RENAMES = (
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
    (re.compile(r"\btools\[(\d+)\]\.function\.(name|description)\b"), r"tools[\1].\2"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
    (re.compile(r"\bresponse_format\b"), "output_config.format"),
    (re.compile(r'\btool_choice "required"'), 'tool_choice "any"'),
    (re.compile(r"\b(chat_template_kwargs|thinking_token_budget|include_reasoning)\b"), "thinking"),
)


def renamed(e: ApiError) -> ApiError:
    """An error raised in chat terms, in the names this request used."""
    for pattern, name in RENAMES:
        e.message = pattern.sub(name, e.message)
        e.param = pattern.sub(name, e.param) if e.param else e.param
    return e


def parse_messages(
    body: object, request_id: str, tool_parser: str | None = None, strict: bool = True
) -> protocol.ApiRequest:
    """A /v1/messages body as the internal request. tool_parser, strict: as parse_chat's."""
    try:
        return protocol.parse_chat(to_chat(body), request_id, tool_parser, strict)
    except ApiError as e:
        raise renamed(e) from None


def parse_count_tokens(body: object) -> pb.GenerateRequest:
    """A /v1/messages/count_tokens body: the conversation and tools as /v1/messages renders them."""
    chat = to_chat(body, count=True)
    try:
        req = protocol.parse_chat(chat, "count_tokens", tool_parser=None)
    except ApiError as e:
        raise renamed(e) from None
    return req.generate


def to_chat(body: object, count: bool = False) -> dict:
    """The chat completions body that asks what this Messages body asks."""
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {kind(body)}")
    known = COUNT_FIELDS if count else MESSAGE_FIELDS
    for name in body:
        if name not in known and name not in ACCEPTED:
            raise bad_request(name, f"{name}: Extra inputs are not permitted")
    chat: dict = {"model": body.get("model")}
    if not count:
        if body.get("max_tokens") is None:
            raise bad_request("max_tokens", "max_tokens: Field required")
        chat["max_completion_tokens"] = body["max_tokens"]
        for name in ("temperature", "top_p", "top_k", "stream"):
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("stop_sequences") is not None:
            chat["stop"] = body["stop_sequences"]
        _output_config(body.get("output_config"), chat)
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    last = chat["messages"][-1] if chat["messages"] else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
        # Prefill: the answer continues the assistant's last words.
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    _tools(body, chat)
    _thinking(body.get("thinking"), chat)
    return chat


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        parts = [p for p in _text_parts(system, "system") if not p["text"].startswith(BILLING_HEADER)]
        return [{"role": "system", "content": parts}] if parts else []
    raise bad_request("system", f"system must be a string or an array of text blocks, got {kind(system)}")


def _text_parts(blocks: list, where: str) -> list[dict]:
    parts = []
    for i, block in enumerate(blocks):
        _refuse_media(block, f"{where}[{i}]")
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise bad_request(f"{where}[{i}]", f'{where}[{i}] must be {{"type": "text", "text": ...}}')
        parts.append({"type": "text", "text": block["text"]})
    return parts


def _refuse_media(block, where: str) -> None:
    if isinstance(block, dict) and block.get("type") in ("image", "document"):
        raise bad_request(
            f"{where}.type",
            f"{where}: {block['type']} blocks are not supported here (images: in user turns only)",
        )


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty array of {role, content}")
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for the tool turns that answer it
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        role = CLAUDE_CODE_ROLES.get(role, role)
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role", f'{where}.role must be "user" or "assistant"')
        content = m.get("content")
        if role == "system":
            out += _system(content)
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            convert = _assistant if role == "assistant" else _user
            out += convert(content, f"{where}.content", names)
        else:
            raise bad_request(f"{where}.content", f"{where}.content must be a string or an array of blocks")
    return out


def _user(blocks: list, where: str, names: dict[str, str]) -> list[dict]:
    """A user turn: its tool results as tool messages, then its text (if any)."""
    tools, parts = [], []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        kind_ = block.get("type") if isinstance(block, dict) else None
        if kind_ == "image":  # the chat's image_url part: the router reads it under its media policy
            parts.append(_image(block, at))
            continue
        _refuse_media(block, at)
        if kind_ == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind_ == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{at}.tool_use_id", f"{at}.tool_use_id: Field required")
            content = block.get("content", "")
            text = content if isinstance(content, str) else _text_parts(content, f"{at}.content")
            if isinstance(text, list):
                text = "\n".join(p["text"] for p in text)
            tool = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                tool["name"] = names[call_id]
            tools.append(tool)
        else:
            raise bad_request(at, f"{at}: a user turn holds text and tool_result blocks, got {kind(block)}")
    return tools + ([{"role": "user", "content": parts}] if parts else [])


def _image(block: dict, where: str) -> dict:
    """An image block as an image_url part: base64 data as a data: URL, a url source as its link."""
    source = block.get("source")
    kind_ = source.get("type") if isinstance(source, dict) else None
    if (
        kind_ == "base64"
        and isinstance(source.get("media_type"), str)
        and isinstance(source.get("data"), str)
    ):
        return {
            "type": "image_url",
            "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"},
        }
    if kind_ == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(
        f"{where}.source",
        f'{where}.source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", "url"}}',
    )


def _assistant(blocks: list, where: str, names: dict[str, str]) -> list[dict]:
    """An assistant turn: its text and its tool_use blocks as tool_calls."""
    parts, calls = [], []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        kind_ = block.get("type") if isinstance(block, dict) else None
        if kind_ == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind_ == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(at, f"{at}: a tool_use block needs a string id and name")
            if not isinstance(block.get("input", {}), dict):
                raise bad_request(f"{at}.input", f"{at}.input must be an object")
            names[block["id"]] = block["name"]
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind_ in ("thinking", "redacted_thinking"):
            continue  # past reasoning: templates leave it out
        else:
            raise bad_request(at, f"{at}: an assistant turn holds text, tool_use and thinking blocks")
    message: dict = {"role": "assistant", "content": parts or ("" if not calls else None)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools", f"tools must be an array, got {kind(tools)}")
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)] or None
        if chat["tools"] is None:
            del chat["tools"]
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice", 'tool_choice must be {"type": "auto" | "any" | "tool" | "none"}')
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name", "tool_choice.name: Field required")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _tool(tool, where: str) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise bad_request(where, f"{where} must be an object with a string name")
    if tool.get("type") not in (None, "custom"):
        raise bad_request(
            f"{where}.type",
            f"{where}.type {tool['type']!r}: server tools are not run here; send custom tools",
        )
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.input_schema", f"{where}.input_schema: a JSON Schema object is required")
    if "type" not in schema:  # as vLLM: a schema of properties alone is an object's
        schema = {"type": "object"} | schema
    if schema.get("type") != "object":
        raise bad_request(f"{where}.input_schema.type", f'{where}.input_schema.type must be "object"')
    function = {"name": tool["name"], "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _output_config(config, chat: dict) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise bad_request("output_config", f"output_config must be an object, got {kind(config)}")
    fmt = config.get("format")
    if fmt is not None:
        if (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            raise bad_request(
                "output_config.format",
                'output_config.format must be {"type": "json_schema", "schema": {...}}',
            )
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt["schema"]},
        }


def _thinking(thinking, chat: dict) -> None:
    """Extended thinking, as the chat fields of a reasoning model's request (--reasoning-parser): enabled
    turns the template's thinking on (Qwen3's enable_thinking) with budget_tokens as the thinking budget (the
    think block closed after that many tokens); adaptive the same without a budget; disabled turns it off.
    Absent: the template's default."""
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad_request(
            "thinking", 'thinking must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}'
        )
    chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    if thinking["type"] == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad_request("thinking.budget_tokens", "thinking.budget_tokens must be a positive integer")
        chat["thinking_token_budget"] = budget
