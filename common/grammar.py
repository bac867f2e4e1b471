"""Structured outputs: what a request's grammar is (a GrammarSpec, from tpserve.v1.StructuredOutput) and how
it becomes an llguidance grammar. The router checks it with this (so a bad grammar is INVALID_ARGUMENT at
once) and rank 0 compiles it with this, so both agree on what a spec means.

llguidance (Rust, no dependencies) was chosen over xgrammar by measuring (bench/grammar_libs.py): about
ten times faster to compile, 1.2-1.4 ms to fill the masks of 64 sequences on SmolLM2's 49k vocab, and
nothing that could replace our torch. It is imported only where a grammar is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message is llguidance's (position and reason)."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's grammar, hashable: compiled grammars are cached by it."""

    kind: str  # one of KINDS
    text: str  # the schema (JSON text), regex, grammar, or the choices as a JSON list; "" for json_object
    whitespace_flexible: bool = False

    @classmethod
    def from_proto(cls, msg) -> GrammarSpec | None:
        """From a tpserve.v1.StructuredOutput; None when no kind is set."""
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "choice":
            text = json.dumps(list(msg.choice.choices))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(msg, kind)
        return cls(kind, text, msg.whitespace_flexible)

    def to_proto(self):
        from common.pb.tpserve.v1 import generation_pb2 as pb

        msg = pb.StructuredOutput(whitespace_flexible=self.whitespace_flexible)
        if self.kind == "choice":
            msg.choice.choices.extend(json.loads(self.text))
        elif self.kind == "json_object":
            msg.json_object = True
        else:
            setattr(msg, self.kind, self.text)
        return msg


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON form) for spec. Raises GrammarError for what cannot be converted
    (a schema that is not JSON, a GBNF grammar that does not parse); llguidance itself finds the rest
    (validate)."""
    import llguidance
    from llguidance import LLMatcher

    # Compact JSON (no whitespace) unless asked: flexible whitespace lets a small model wander into endless
    # newlines (vLLM's disable_any_whitespace).
    options = {"whitespace_flexible": spec.whitespace_flexible}
    try:
        if spec.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec.text, defaults=options)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("choice needs at least one string, and none empty")
            # Lark string literals are JSON strings: any text is escaped exactly.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind == "grammar":
            # Lark, or GBNF (llama.cpp's, which vLLM's guided_grammar also takes): llguidance tells them
            # apart and converts GBNF to Lark.
            return llguidance.grammar_from("grammar", spec.text)
    except ValueError as e:  # not JSON, or a GBNF grammar that does not convert
        raise GrammarError(str(e)) from None
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def validate(spec: GrammarSpec) -> None:
    """Raises GrammarError unless spec compiles (no tokenizer needed: the rules, regexes and schema are
    checked; about half a millisecond for a typical schema)."""
    from llguidance import LLMatcher

    message = LLMatcher.validate_grammar(llguidance_grammar(spec))
    if message:
        raise GrammarError(message.strip())


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (JSON Schema 2020-12
# and the drafts before it): the places a nested object or array can hide.
_ONE = ("additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems", "contains")
_ONE += ("not", "if", "then", "else", "propertyNames")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Siblings that may add properties an object's own additionalProperties would forbid.
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")


def strict_schema(schema, close: bool = True):
    """schema with no properties or items beyond those it names (xgrammar's strict mode, vLLM's default
    and what OpenAI's strict function calling requires): every object that names `properties` or
    `patternProperties` and sets neither additionalProperties nor unevaluatedProperties gets
    `additionalProperties: false`, every `prefixItems` (or tuple `items`) without a rule for the rest
    admits nothing after it. What a schema sets explicitly is kept. A new schema; the given one is not
    changed.

    Left open, because closing them would forbid what the schema allows: an object that names no
    properties ({"type": "object"}: any object), and the level at which an object's properties come from
    several allOf members or from anyOf/oneOf beside its own (JSON Schema closes those with
    unevaluatedProperties, which llguidance does not implement). unevaluatedProperties on an object
    without such siblings means additionalProperties and is given to llguidance as that."""
    if not isinstance(schema, dict):
        return schema  # true / false
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _MANY:
        if isinstance(out.get(key), list):
            # Members of an allOf each see part of the object: none may close it alone.
            members_close = key != "allOf" or len(out[key]) == 1
            out[key] = [strict_schema(sub, close=members_close) for sub in out[key]]
    items = out.get("items")
    if isinstance(items, dict):
        out["items"] = strict_schema(items)
    elif isinstance(items, list):
        out["items"] = [strict_schema(sub) for sub in items]
    applied = any(key in out for key in _APPLICATORS)
    if "unevaluatedProperties" in out and "additionalProperties" not in out and not applied:
        out["additionalProperties"] = out.pop("unevaluatedProperties")
    if not close:
        return out
    names = "properties" in out or "patternProperties" in out
    if names and not applied and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    if isinstance(out.get("items"), list) and "additionalItems" not in out:
        out["additionalItems"] = False
    return out
