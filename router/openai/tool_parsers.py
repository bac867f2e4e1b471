"""Tool calls parsed out of a model's text, chosen by --tool-call-parser as vLLM names them:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, anywhere in the text
  (Hermes, Qwen2.5 and Qwen3, and most ChatML-style tool templates).
- llama3_json: an answer that starts with a JSON object `{"name": ..., "parameters": {...}}` (or
  "arguments"), several separated by ';', optionally after `<|python_tag|>` (Llama 3.1 to 3.3).
- mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"}, or (tokenizer v11 and later)
  `[TOOL_CALLS]name{...}` / `[TOOL_CALLS]name[ARGS]{...}` per call. [TOOL_CALLS] is a special token, so
  the request's text keeps special tokens (needs_special_tokens).

Each parser is incremental: feed(text) returns what can be told apart so far, content deltas and whole tool
calls, and holds back any text that may still turn out to open a call; finish() settles the rest. The whole
answer is the same parser fed everything, so a streamed answer and a whole one never disagree. A call whose
JSON does not parse is returned as the text it was, as vLLM does, rather than dropped.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    """What a feed or finish produced: content text and tool calls, in that order within one delta."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


def held_prefix(text: str, marker: str) -> int:
    """How many characters at text's end may be the start of marker (so must be held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base: content passes through, holding back whitespace that may only separate tool calls."""

    needs_special_tokens = False
    cut = False  # finish() reported a call its answer stopped inside (ForcedCalls)

    def __init__(self):
        self._ws = ""  # whitespace-only content not sent yet: dropped if a call follows it
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        out = self.feed(text)
        out += self.finish()
        return out

    def _content(self, text: str) -> Parsed:
        # Trailing whitespace waits: it is content only if more content follows (or no call ever does),
        # so the spacing a template puts between calls never reaches the client, however text is chunked.
        body = text.rstrip()
        if not body:
            self._ws += text
            return Parsed()
        sent, self._ws = self._ws + body, text[len(body) :]
        return Parsed(content=sent)

    def _call(self, name, arguments) -> Parsed:
        self._ws = ""
        self.num_calls += 1
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return Parsed(calls=[ToolCall(self._new_id(), name, args)])

    def _end(self) -> Parsed:
        """Trailing whitespace is content only in an answer without calls."""
        ws, self._ws = self._ws, ""
        return Parsed(content=ws if not self.num_calls else "")

    def _new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


def _call_object(obj) -> tuple[str, object] | None:
    """(name, arguments) of {"name": ..., "arguments"|"parameters": {...}}, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get("arguments", obj.get("parameters", {}))


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while True:
            if not self._in_call:
                start = self._buf.find(self.OPEN)
                if start < 0:
                    keep = held_prefix(self._buf, self.OPEN)
                    out += self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out += self._content(self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(self.OPEN) :], True
            end = self._buf.find(self.CLOSE)
            if end < 0:
                return out
            out += self._settle(self._buf[:end], closed=True)
            self._buf, self._in_call = self._buf[end + len(self.CLOSE) :], False

    def finish(self) -> Parsed:
        out = self._settle(self._buf, closed=False) if self._in_call else self._content(self._buf)
        self._buf, self._in_call = "", False
        out += self._end()
        return out

    def _settle(self, body: str, closed: bool) -> Parsed:
        try:
            call = _call_object(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            return self._content(self.OPEN + body + (self.CLOSE if closed else ""))
        return self._call(*call)


class Llama3JsonParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._mode = None  # None: undecided; "text" or "calls"
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> Parsed:
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
                return Parsed()  # not decided yet
            if head.startswith(self.PYTHON_TAG):
                self._mode, self._buf = "calls", head[len(self.PYTHON_TAG) :]
            elif head.startswith("{"):
                self._mode, self._buf = "calls", head
            else:
                self._mode = "text"
        if self._mode == "text":
            text, self._buf = self._buf, ""
            return Parsed(content=text)
        return self._calls()

    def _calls(self) -> Parsed:
        out = Parsed()
        while True:
            rest = self._buf.lstrip().lstrip(";").lstrip()
            if not rest:
                self._buf = ""
                return out
            try:
                obj, end = self._decoder.raw_decode(rest)
            except ValueError:
                self._buf = rest  # incomplete (or broken: finish() returns it as text)
                return out
            call = _call_object(obj)
            if call is None:  # JSON, but not a call: the rest is text
                self._mode = "text"
                self._buf = ""
                out.content += rest
                return out
            out += self._call(*call)
            self._buf = rest[end:]

    def finish(self) -> Parsed:
        out = Parsed(content=self._buf if self._buf.strip() or not self.num_calls else "")
        self._buf, self._mode = "", "text"
        return out


class MistralParser(ToolParser):
    BOT = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    needs_special_tokens = True
    _ID_CHARS = string.ascii_letters + string.digits

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._in_calls = False

    def feed(self, text: str) -> Parsed:
        self._buf += text
        if not self._in_calls:
            start = self._buf.find(self.BOT)
            if start < 0:
                keep = held_prefix(self._buf, self.BOT)
                out = self._content(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            out = self._content(self._buf[:start])
            self._buf, self._in_calls = self._buf[start:], True
        else:
            out = Parsed()
        # v11+: each [TOOL_CALLS] after the first closes the call before it.
        pieces = self._buf.split(self.BOT)
        if not pieces[1].lstrip().startswith("["):
            for piece in pieces[1:-1]:
                out += self._named_call(piece)
            self._buf = self.BOT + pieces[-1]
        return out

    def finish(self) -> Parsed:
        if not self._in_calls:
            out = self._content(self._buf)
        else:
            body = self._buf[len(self.BOT) :]
            out = self._array(body) if body.lstrip().startswith("[") else self._named_call(body)
        self._buf, self._in_calls = "", False
        out += self._end()
        return out

    def _array(self, body: str) -> Parsed:
        try:
            calls = [_call_object(c) for c in json.loads(body)]
        except (ValueError, TypeError):
            calls = [None]
        if not calls or None in calls:
            return self._content(self.BOT + body)
        out = Parsed()
        for call in calls:
            out += self._call(*call)
        return out

    def _named_call(self, piece: str) -> Parsed:
        name, sep, arguments = piece.partition(self.ARGS)
        if not sep:
            brace = piece.find("{")
            name, arguments = (piece[:brace], piece[brace:]) if brace >= 0 else (piece, "")
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not name.strip() or not isinstance(parsed, dict):
            return self._content(self.BOT + piece)
        return self._call(name.strip(), parsed)

    def _new_id(self) -> str:
        # Mistral's templates check tool call ids: 9 letters or digits.
        return "".join(random.choices(self._ID_CHARS, k=9))


class ForcedCalls(ToolParser):
    """tool_choice "required" or a named function: the whole answer is the call, as the grammar built from
    tools.output_schema made it: the named function's arguments object, or for "required" an array of
    {"name", "parameters"}. Read once the answer ends (a call is sent whole, streamed or not). An answer cut
    short (max_tokens) is still the calls it began: the complete ones, then the last with its arguments as
    far as they were written (a JSON prefix), and `cut` set so the finish reason stays "length"."""

    # The start of one item of "required"'s array as the grammar writes it: its name first (the schema's
    # order), then the parameters.
    _NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*')
    _PARAMETERS = re.compile(r',\s*"parameters"\s*:\s*')

    def __init__(self, name: str | None = None):
        super().__init__()
        self.name = name  # the named function; None: "required"
        self._buf = ""
        self.cut = False  # the last call's arguments end before their JSON does

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return Parsed()

    def finish(self) -> Parsed:
        text, self._buf = self._buf, ""
        try:
            value = json.loads(text)
        except ValueError:
            return self._cut(text)
        if self.name is not None:
            return self._call(self.name, value)
        out = Parsed()
        for item in value:
            out += self._call(item["name"], item.get("parameters", {}))
        return out

    def _cut(self, text: str) -> Parsed:
        """The calls of an answer whose JSON stops short; the text as content only where no call's name
        was written (so there is none to report)."""
        if self.name is not None:
            if not text.strip():
                return Parsed(content=text)
            self.cut = True
            return self._call(self.name, text.strip())
        out, rest, decoder = Parsed(), text.lstrip(), json.JSONDecoder()
        if not rest.startswith("["):
            return Parsed(content=text)
        rest = rest[1:]
        while True:
            try:  # a whole item, then "," or "]"
                item, end = decoder.raw_decode(rest.lstrip())
            except ValueError:
                break
            out += self._call(item["name"], item.get("parameters", {}))
            rest = rest.lstrip()[end:].lstrip().removeprefix(",")
        name = self._NAME.match(rest)
        if name is not None:
            self.cut = True
            # The arguments as far as they go: none yet while "parameters" itself is being written.
            arguments = self._PARAMETERS.match(rest, name.end())
            out += self._call(
                json.loads(name.group(1)), rest[arguments.end() :].rstrip() if arguments else ""
            )
        elif not out.calls:
            return Parsed(content=text)
        else:
            self.cut = True  # cut between calls, or inside a name: the calls written whole
        return out


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
