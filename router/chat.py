"""A chat prompt: the GenerateRequest's conversation checked and put in the shape chat templates read.

Templates are Jinja over Hugging Face's message dicts: {"role", "content"}, an assistant's "tool_calls"
({"id", "type": "function", "function": {"name", "arguments"}}), a tool turn's "tool_call_id", and the
`tools` list ({"type": "function", "function": {"name", "description", "parameters"}}). Arguments travel
as JSON text and are handed to the template as the object they hold, as vLLM does, since templates
iterate over them or dump them with tojson. What a template does with tools is its own (SmolLM2's ignores
them); the router renders what the checkpoint's template says, no more.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from common.pb.tpserve.v1 import generation_pb2
from router.validation_error import ValidationError

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHAT_ONLY_FIELDS = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs_json")
# apply_chat_template's own arguments: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    (
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    )
)


@dataclass(frozen=True)
class ChatPrompt:
    """What Tokenizer.render_chat renders: transformers' apply_chat_template arguments."""

    messages: list[dict]
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the template writes
    # chat_template_kwargs (Qwen3's enable_thinking) and reasoning_effort, for the template's own use.
    template_kwargs: dict | None = None


def check_chat(req: generation_pb2.GenerateRequest, max_messages: int, max_chars: int) -> None:
    """The conversation and its options, before anything is rendered."""
    if not req.messages:
        for name in CHAT_ONLY_FIELDS:
            present = req.HasField(name) if name == "add_generation_prompt" else bool(getattr(req, name))
            if present:
                raise ValidationError(name, f"{name} applies to chat prompts (messages) only")
        return
    if len(req.messages) > max_messages:
        raise ValidationError("messages", f"{len(req.messages)} messages; the limit is {max_messages}")
    if req.continue_final_message and req.HasField("add_generation_prompt") and req.add_generation_prompt:
        raise ValidationError(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true: the first continues the "
            "last message, the second starts a new one",
        )
    chars = 0
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise ValidationError(
                f"messages[{i}].role",
                f"messages[{i}].role is {m.role!r}; it must be one of {', '.join(CHAT_ROLES)}",
            )
        if m.tool_calls and m.role != "assistant":
            raise ValidationError(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
        for j, call in enumerate(m.tool_calls):
            field = f"messages[{i}].tool_calls[{j}]"
            if not call.name:
                raise ValidationError(f"{field}.function.name", f"{field}.function.name is empty")
            _json_object(call.arguments_json or "{}", f"{field}.function.arguments")
            chars += len(call.name) + len(call.arguments_json)
        chars += len(m.content) + sum(len(p.text) for p in m.parts)
    _check_tools(req.tools)
    if req.chat_template_kwargs_json:
        kwargs = _json_object(req.chat_template_kwargs_json, "chat_template_kwargs")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise ValidationError(
                "chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}"
            )
        chars += len(req.chat_template_kwargs_json)
    chars += sum(len(t.name) + len(t.description) + len(t.parameters_json) for t in req.tools)
    if chars > max_chars:
        raise ValidationError("messages", f"messages hold {chars} characters; the limit is {max_chars}")


def chat_prompt(req: generation_pb2.GenerateRequest) -> ChatPrompt:
    """The checked request (check_chat) as the template's arguments."""
    add_generation_prompt = (
        req.add_generation_prompt if req.HasField("add_generation_prompt") else not req.continue_final_message
    )
    return ChatPrompt(
        messages=[_message(m) for m in req.messages],
        tools=[_tool(t) for t in req.tools] or None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=req.continue_final_message,
        add_special_tokens=req.add_special_tokens if req.HasField("add_special_tokens") else False,
        template_kwargs=template_kwargs(req) or None,
    )


def template_kwargs(req: generation_pb2.GenerateRequest) -> dict:
    """What the template is given besides the conversation: chat_template_kwargs, and reasoning_effort as
    vLLM passes it (a template that does not read a name ignores it)."""
    out = json.loads(req.chat_template_kwargs_json) if req.chat_template_kwargs_json else {}
    if req.reasoning_effort:
        out.setdefault("reasoning_effort", req.reasoning_effort)
    return out


def _message(m: generation_pb2.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": _parts(m.parts) if m.parts else m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments_json or "{}")},
            }
            for c in m.tool_calls
        ]
    return out


def _parts(parts) -> list[dict]:
    """Content parts as Hugging Face templates read them: an image is {"type": "image"} (the template
    writes the family's image marker, which the processor expands), text is {"type": "text", "text"}."""
    return [
        {"type": "text", "text": p.text} if p.WhichOneof("kind") == "text" else {"type": "image"}
        for p in parts
    ]


def _tool(t: generation_pb2.Tool) -> dict:
    function: dict = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = json.loads(t.parameters_json) if t.parameters_json else {"type": "object"}
    return {"type": "function", "function": function}


def _check_tools(tools: Sequence[generation_pb2.Tool]) -> None:
    if len(tools) > MAX_TOOLS:
        raise ValidationError("tools", f"{len(tools)} tools given; the limit is {MAX_TOOLS}")
    seen = set()
    for i, t in enumerate(tools):
        if not TOOL_NAME.fullmatch(t.name):
            raise ValidationError(
                f"tools[{i}].function.name",
                f"tools[{i}].function.name {t.name!r} must be 1 to 64 letters, digits, '_' or '-'",
            )
        if t.name in seen:
            raise ValidationError(f"tools[{i}].function.name", f"two tools are named {t.name!r}")
        seen.add(t.name)
        if t.parameters_json:
            _json_object(t.parameters_json, f"tools[{i}].function.parameters")


def _json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValidationError(field, f"{field} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValidationError(field, f"{field} must be a JSON object")
    return value
