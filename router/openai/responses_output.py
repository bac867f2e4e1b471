"""The chat completion answer and chunks (encoder.py) as a Responses API response object and its stream of
events: response.created and response.in_progress, then per output item (reasoning, message, function
call, in the order the answer says them) response.output_item.added, its part's deltas
(response.reasoning_text.delta, response.output_text.delta, response.function_call_arguments.delta) and
.done events, response.output_item.done; then response.completed (or response.incomplete when
max_output_tokens cut it). Every event has a sequence_number from 0.

The streamed answer's last event carries the response object built by the same function as the whole
answer's (`response`), from the same text, reasoning and calls, so the two cannot disagree.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from router.openai.errors import ApiError


@dataclass
class Said:
    """What the answer said so far: one message's reasoning, content and tool calls (chat's shapes)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)
    finish: str | None = None

    @classmethod
    def of(cls, whole: dict) -> Said:
        choice = whole["choices"][0]
        msg = choice["message"]
        reasoning = msg.get("reasoning") or msg.get("reasoning_content") or ""
        return cls(
            reasoning, msg.get("content") or "", list(msg.get("tool_calls") or ()), choice["finish_reason"]
        )

    def assistant(self) -> dict:
        """The answer as the chat message a later turn reads (previous_response_id)."""
        out: dict = {"role": "assistant", "content": self.content or None}
        if self.calls:
            out["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": dict(c["function"])} for c in self.calls
            ]
        return out


def _reasoning_item(rid: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": content, "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(rid: str, text: str, status: str) -> dict:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant", "content": content}


def _call_item(rid: str, i: int, call: dict, status: str) -> dict:
    arguments = call["function"]["arguments"] if status == "completed" else ""
    return {
        "type": "function_call",
        "id": f"fc_{rid}_{i}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


def usage(chat_usage: dict | None, cached_tokens: int = 0) -> dict | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
        "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"],
    }


def response(
    rid: str, model: str, created: int, echo: dict, said: Said | None, usage_: dict | None = None
) -> dict:
    """The response object; said None: not answered yet (in progress)."""
    output, status, incomplete = [], "in_progress", None
    if said is not None:
        if said.reasoning:
            output.append(_reasoning_item(rid, said.reasoning, "completed"))
        if said.content:
            output.append(_message_item(rid, said.content, "completed"))
        output += [_call_item(rid, i, c, "completed") for i, c in enumerate(said.calls)]
        status = "completed"
        if said.finish == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "usage": usage_,
    } | echo


class ResponseStream:
    """One answer's events, fed the chat chunks as they come."""

    def __init__(self, rid: str, model: str, echo: dict, created: int | None = None):
        self.rid, self.model, self.echo = rid, model, echo
        self.created = int(time.time()) if created is None else created
        self.said = Said()
        self._seq = 0
        self._index = -1  # the open output item's
        self._open: str | None = None  # its type: "reasoning" or "message" (calls are sent whole)

    def _event(self, kind: str, **data) -> bytes:
        body = {"type": kind, "sequence_number": self._seq} | data
        self._seq += 1
        return (
            f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()
        )

    def start(self) -> list[bytes]:
        head = response(self.rid, self.model, self.created, self.echo, None)
        return [
            self._event("response.created", response=head),
            self._event("response.in_progress", response=head),
        ]

    def _item_id(self) -> str:
        return f"rs_{self.rid}" if self._open == "reasoning" else f"msg_{self.rid}"

    def _begin(self, kind: str) -> list[bytes]:
        if self._open == kind:
            return []
        out = self._close()
        self._index += 1
        self._open = kind
        if kind == "reasoning":
            item, part = _reasoning_item(self.rid, "", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = _message_item(self.rid, "", "in_progress"), _text_part("")
        where = {"item_id": self._item_id(), "output_index": self._index, "content_index": 0}
        return out + [
            self._event("response.output_item.added", output_index=self._index, item=item),
            self._event("response.content_part.added", **where, part=part),
        ]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        where = {"item_id": self._item_id(), "output_index": self._index, "content_index": 0}
        if self._open == "reasoning":
            text, part = self.said.reasoning, {"type": "reasoning_text", "text": self.said.reasoning}
            item = _reasoning_item(self.rid, text, "completed")
            done = self._event("response.reasoning_text.done", **where, text=text)
        else:
            text, part = self.said.content, _text_part(self.said.content)
            item = _message_item(self.rid, text, "completed")
            done = self._event("response.output_text.done", **where, text=text, logprobs=[])
        self._open = None
        return [
            done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=self._index, item=item),
        ]

    def feed(self, chunk: dict | None) -> list[bytes]:
        """The events of one chat chunk (None: it had nothing to say)."""
        if chunk is None or not chunk["choices"]:
            return []
        choice = chunk["choices"][0]
        self.said.finish = choice["finish_reason"] or self.said.finish
        delta, out = choice["delta"], []
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            out += self._begin("reasoning")
            self.said.reasoning += reasoning
            where = {"item_id": self._item_id(), "output_index": self._index, "content_index": 0}
            out.append(self._event("response.reasoning_text.delta", **where, delta=reasoning))
        if delta.get("content"):
            out += self._begin("message")
            self.said.content += delta["content"]
            where = {"item_id": self._item_id(), "output_index": self._index, "content_index": 0}
            out.append(
                self._event("response.output_text.delta", **where, delta=delta["content"], logprobs=[])
            )
        for call in delta.get("tool_calls") or ():
            out += self._close()
            call = {"id": call["id"], "type": "function", "function": dict(call["function"])}
            self._index += 1
            i = len(self.said.calls)
            self.said.calls.append(call)
            item, where = _call_item(self.rid, i, call, "in_progress"), {"output_index": self._index}
            arguments = call["function"]["arguments"]
            out += [
                self._event("response.output_item.added", **where, item=item),
                self._event(
                    "response.function_call_arguments.delta", **where, item_id=item["id"], delta=arguments
                ),
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    item_id=item["id"],
                    name=call["function"]["name"],
                    arguments=arguments,
                ),
                self._event(
                    "response.output_item.done", **where, item=_call_item(self.rid, i, call, "completed")
                ),
            ]
        return out

    def finish(self, usage_: dict | None) -> tuple[list[bytes], dict]:
        """The last events, and the response object they end with."""
        whole = response(self.rid, self.model, self.created, self.echo, self.said, usage_)
        kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
        return self._close() + [self._event(kind, response=whole)], whole

    def error(self, e: ApiError) -> list[bytes]:
        """A failure after the stream began: OpenAI's error event ends it."""
        err = e.body()["error"]
        return [self._event("error", code=err["code"], message=err["message"], param=err["param"])]
