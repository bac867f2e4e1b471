"""Tool calling in a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, and the tool turns of the
history (an assistant's `tool_calls`, a `tool` message's `tool_call_id`), read into tpserve.v1 messages.

What reaches the model is what the checkpoint's chat template makes of them (router/chat.py). The answer's
tool calls are parsed out of its text by --tool-call-parser (tool_parsers.py) when tool_choice is "auto".
"required" and a named function constrain the output to the functions' schemas: `output_schema` gives that
JSON Schema, which becomes the request's grammar, and the answer is the call itself (tool_parsers.py's
ForcedCalls reads it), so a client always gets a call whose arguments follow the function's schema.
Parameters are closed (no keys beyond those named, structured.py) unless the server relaxes schemas; the
wrapper around them for "required" admits only its own two keys whatever the server says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.grammar import strict_schema
from common.pb.tpserve.v1 import generation_pb2 as pb
from router.openai.errors import bad_request
from router.openai.fields import boolean, kind

NONE, AUTO, REQUIRED, FUNCTION = "none", "auto", "required", "function"


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # NONE, AUTO, REQUIRED, or FUNCTION (with name)
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    @property
    def parses(self) -> bool:
        """Whether the answer's text is searched for tool calls."""
        return self.mode != NONE


def parse_tools(body: dict) -> list[pb.Tool]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools", "tools must be a non-empty array (leave it out for none)")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(where, f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}.function", f"{where}.function must be an object with a string name")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise bad_request(
                f"{where}.function.description", f"{where}.function.description must be a string"
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(
                f"{where}.function.parameters", f"{where}.function.parameters must be a JSON Schema object"
            )
        if function.get("strict") and not _forces_call(body):
            raise bad_request(
                f"{where}.function.strict",
                f"{where}.function.strict: arguments are held to the schema only when tool_choice forces a "
                'call ("required" or a named function); with "auto" the model writes them freely',
            )
        out.append(
            pb.Tool(
                name=function["name"],
                description=description,
                parameters_json=json.dumps(parameters) if parameters is not None else "",
            )
        )
    return out


def _forces_call(body: dict) -> bool:
    value = body.get("tool_choice")
    return value == REQUIRED or isinstance(value, dict)


def parse_tool_choice(body: dict, tools: list[pb.Tool], parser: str | None) -> ToolChoice:
    """tool_choice as OpenAI and vLLM default it ("auto" with tools, else "none"), checked against the tools
    and the server's --tool-call-parser."""
    parallel = boolean(body, "parallel_tool_calls", default=True)
    value = body.get("tool_choice")
    if value is None:
        value = AUTO if tools else NONE
    if value == NONE:
        return ToolChoice(NONE, parallel=parallel)
    if not tools:
        raise bad_request("tool_choice", f"tool_choice {json.dumps(value)} needs tools")
    if value == AUTO:
        if parser is None:
            raise bad_request(
                "tool_choice",
                'tool_choice "auto" needs the server started with --tool-call-parser (hermes, llama3_json or '
                'mistral); send tool_choice "none" to give the model tools without parsing its answer',
            )
        return ToolChoice(AUTO, parallel=parallel)
    if value == REQUIRED:
        choice = ToolChoice(REQUIRED, parallel=parallel)
    elif isinstance(value, dict) and value.get("type", "function") == "function":
        name = (value.get("function") or {}).get("name") if isinstance(value.get("function"), dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request(
                "tool_choice.function.name",
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
            )
        if name not in {t.name for t in tools}:
            raise bad_request("tool_choice", f"tool_choice names {name!r}, which is not one of the tools")
        choice = ToolChoice(FUNCTION, name=name, parallel=parallel)
    else:
        raise bad_request(
            "tool_choice",
            f'tool_choice must be "none", "auto", "required" or a named function, got {kind(value)}',
        )
    return choice


def output_schema(tools: list[pb.Tool], choice: ToolChoice, strict: bool = True) -> dict | None:
    """The JSON Schema the answer must follow for tool_choice "required" or a named function (vLLM's): the
    function's parameters for a named one; for "required" an array of {"name", "parameters"} objects, one of
    the tools each, and nothing else in them. None when nothing is enforced ("none", "auto"). strict: the
    parameters are closed (strict_schema)."""

    def parameters(t: pb.Tool) -> dict:
        # No parameters given: the function takes none (OpenAI's reading), so {} once closed.
        schema = json.loads(t.parameters_json) if t.parameters_json else {"type": "object", "properties": {}}
        return strict_schema(schema) if strict else schema

    if choice.mode == FUNCTION:
        return parameters(next(t for t in tools if t.name == choice.name))
    if choice.mode != REQUIRED:
        return None
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not choice.parallel:
        schema["maxItems"] = 1
    return schema


def parse_tool_calls(message: dict, where: str) -> list[pb.ToolCall]:
    """An assistant message's tool_calls ({"id", "type": "function", "function": {"name", "arguments"}})."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls", f"{where}.tool_calls must be an array")
    out = []
    for j, call in enumerate(calls):
        field = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                field, f'{field} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):  # some clients send the object itself
            arguments = json.dumps(arguments)
        if not isinstance(arguments, str):
            raise bad_request(
                f"{field}.function.arguments", f"{field}.function.arguments must be a JSON string"
            )
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise bad_request(f"{field}.id", f"{field}.id must be a string")
        out.append(pb.ToolCall(id=call_id, name=function["name"], arguments_json=arguments))
    return out
