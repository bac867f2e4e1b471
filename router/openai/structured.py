"""Structured outputs in an OpenAI-style body, read into a tpserve.v1.StructuredOutput: OpenAI's
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` object and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields. At most one of them may say what
the output is. Whether the grammar compiles is the Frontend's check (router/sampling_checks.py), whose
error names the field the client used (`param`).

JSON comes in the compact form (vLLM's disable_any_whitespace) unless structured_outputs says
disable_any_whitespace: false: with any whitespace allowed, small models wander into endless newlines.

A JSON Schema is strict unless relaxed (common/grammar.py strict_schema: no properties or items beyond those
it names), as xgrammar, vLLM's default backend, compiles it: a small model held to a schema that allows any
other key goes on adding keys until max_tokens. vLLM's own switch for its guidance backend names it:
`disable_additional_properties`, true here unless the server's --no-disable-additional-properties or the
request's structured_outputs.disable_additional_properties: false says otherwise.
"""

from __future__ import annotations

import json

from common.grammar import strict_schema
from common.pb.tpserve.v1 import generation_pb2 as pb
from router.openai.errors import bad_request
from router.openai.fields import kind

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# vLLM's structured_outputs keys: what the output is, and options that only apply to some backends.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def parse_structured(body: dict, strict: bool = True) -> tuple[pb.StructuredOutput | None, str | None]:
    """The request's structured output and the name of the field it came in (None, None: free text).
    strict: the server's disable_additional_properties (a JSON Schema is closed, strict_schema)."""
    given = [
        name for name in ("response_format", "structured_outputs", *GUIDED) if body.get(name) is not None
    ]
    if body.get("response_format") == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise bad_request(given[1], f"set one of {' and '.join(given)}: both say what the output must be")
    if not given:
        return None, None
    name = given[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value, strict), "response_format"
    if name == "structured_outputs":
        return _structured_outputs(value, strict)
    return _one(name.removeprefix("guided_"), value, name, strict), name


def json_schema(schema: dict, strict: bool) -> str:
    """A schema's JSON text for StructuredOutput.json_schema, closed when strict."""
    return json.dumps(strict_schema(schema) if strict else schema)


def _response_format(value, strict: bool) -> pb.StructuredOutput:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format", 'response_format must be an object with a "type"')
    if value["type"] == "json_object":
        return pb.StructuredOutput(json_object=True)
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request(
                "response_format.json_schema",
                'response_format.json_schema must be {"name": ..., "schema": {...}, "strict": ...}',
            )
        # json_schema.strict true or false, the schema is enforced (a grammar cannot follow it loosely) and
        # closed unless the server relaxes it (vLLM ignores the field too).
        return pb.StructuredOutput(json_schema=json_schema(spec["schema"], strict))
    raise bad_request(
        "response_format",
        f'response_format type must be "text", "json_object" or "json_schema", got {value["type"]!r}',
    )


def _structured_outputs(value, strict: bool) -> tuple[pb.StructuredOutput, str]:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs", f"structured_outputs must be an object, got {kind(value)}")
    unknown = [k for k in value if k not in STRUCTURED_KINDS + STRUCTURED_OPTIONS]
    if unknown:
        raise bad_request(
            f"structured_outputs.{unknown[0]}", f"unrecognized field structured_outputs.{unknown[0]}"
        )
    given = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(
            "structured_outputs",
            "structured_outputs: set exactly one of json, regex, choice, grammar or json_object",
        )
    name = f"structured_outputs.{given[0]}"
    if given[0] == "structural_tag":
        raise bad_request(name, f"{name} is not supported by tpserve (use json, regex, choice or grammar)")
    closed = value.get("disable_additional_properties")
    if closed is not None and not isinstance(closed, bool):
        raise bad_request(
            "structured_outputs.disable_additional_properties",
            f"structured_outputs.disable_additional_properties must be a boolean, got {kind(closed)}",
        )
    out = (
        pb.StructuredOutput(json_object=True)
        if given[0] == "json_object"
        else _one(given[0], value[given[0]], name, strict if closed is None else closed)
    )
    # vLLM's disable_any_whitespace false (said explicitly): any whitespace between JSON tokens. Unset or
    # true: the compact form. disable_fallback has nothing to do: there is one backend.
    out.whitespace_flexible = value.get("disable_any_whitespace") is False
    return out, name


def _one(what: str, value, name: str, strict: bool) -> pb.StructuredOutput:
    """json (a schema object, or its JSON text), regex, choice (strings) or grammar (Lark or GBNF)."""
    if what == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:  # the grammar check (router/sampling_checks.py) says where it breaks
                return pb.StructuredOutput(json_schema=value)
        if isinstance(value, dict):
            return pb.StructuredOutput(json_schema=json_schema(value, strict))
        if isinstance(value, bool):  # true / false are schemas too
            return pb.StructuredOutput(json_schema=json.dumps(value))
        raise bad_request(
            name, f"{name} must be a JSON Schema (an object, or its JSON text), got {kind(value)}"
        )
    if what == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(name, f"{name} must be a non-empty array of non-empty strings")
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    if not isinstance(value, str) or not value:
        raise bad_request(name, f"{name} must be a non-empty string, got {kind(value)}")
    return pb.StructuredOutput(regex=value) if what == "regex" else pb.StructuredOutput(grammar=value)
