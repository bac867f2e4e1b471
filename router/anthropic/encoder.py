"""The chat completion answer and chunks (router/openai/encoder.py) as Anthropic's Message and its stream of
events: message_start, then per content block content_block_start / content_block_delta (thinking_delta,
text_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, usage) and
message_stop. Blocks come in the order the answer says them: reasoning, text, tool calls.

stop_reason: tool_use once a call was made, max_tokens for the length limit, stop_sequence for a stop
string (named in stop_sequence: GenerateResponse.stop_string), end_turn for the end of the turn; a turn the
server ended (shutting down) is pause_turn, which a client continues by sending it back.
"""

from __future__ import annotations

import json

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.openai.errors import ApiError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(e: ApiError) -> dict:
    """Anthropic's error shape."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def _reasoning(part: dict) -> str:
    """A message's or delta's reasoning text (vLLM's field, and its older alias)."""
    return part.get("reasoning") or part.get("reasoning_content") or ""


def _input(arguments: str) -> dict:
    """A call's arguments as tool_use's input (an object); a call cut short (max_tokens) has none whole."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, reason: int) -> str:
    """finish: the chat choice's finish_reason; reason: the internal one (tells EOS from a stop string)."""
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    if reason == pb.FINISH_REASON_ABORTED:
        return "pause_turn"
    return "stop_sequence" if reason == pb.FINISH_REASON_STOP else "end_turn"


def stop_sequence(last: pb.GenerateResponse) -> str | None:
    """The stop sequence that ended the answer (last: its last response)."""
    return (last.stop_string or None) if last.finish_reason == pb.FINISH_REASON_STOP else None


def usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"]}


def message(whole: dict, message_id: str, last: pb.GenerateResponse) -> dict:
    """The whole chat completion as a Message. last: the answer's last response (its finish reason tells
    EOS from a stop sequence, and names the sequence)."""
    choice = whole["choices"][0]
    msg = choice["message"]
    content = []
    if _reasoning(msg):
        content.append({"type": "thinking", "thinking": _reasoning(msg), "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _input(function["arguments"]),
            }
        )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": whole["model"],
        "content": content,
        "stop_reason": stop_reason(choice["finish_reason"], last.finish_reason),
        "stop_sequence": stop_sequence(last),
        "usage": usage(whole["usage"]),
    }


class MessageStream:
    """One answer's events, fed the chat chunks as they come."""

    def __init__(self, message_id: str, model: str):
        self.id = message_id
        self.model = model
        self._index = -1  # the open block's (or the last one's)
        self._open: str | None = None  # its type
        self._finish: str | None = None
        self._last = pb.GenerateResponse()  # the last response that finished the answer

    def start(self) -> list[bytes]:
        head = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # The prompt's length comes with the last response: message_delta carries it.
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [
            event("message_start", {"type": "message_start", "message": head}),
            event("ping", {"type": "ping"}),
        ]

    def _block(self, kind: str, block: dict) -> list[bytes]:
        """Opens a block of this kind unless one is open (a tool_use block always opens its own)."""
        if self._open == kind and kind != "tool_use":
            return []
        out = self._close()
        self._index += 1
        self._open = kind
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return out + [event("content_block_start", start)]

    def _delta(self, delta: dict) -> bytes:
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
        )

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def feed(self, resp: pb.GenerateResponse, chunk: dict | None) -> list[bytes]:
        """The events of one response (chunk: its chat chunk, None when it had nothing to say)."""
        if resp.finish_reason:
            self._last = resp
        if chunk is None or not chunk["choices"]:
            return []
        choice = chunk["choices"][0]
        self._finish = choice["finish_reason"] or self._finish
        delta, out = choice["delta"], []
        if _reasoning(delta):
            out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": _reasoning(delta)}))
        if delta.get("content"):
            out += self._block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            function = call["function"]
            block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            out += self._block("tool_use", block)
            out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def finish(self, chat_usage: dict) -> list[bytes]:
        """The last events, once every response was fed."""
        delta = {
            "stop_reason": stop_reason(self._finish, self._last.finish_reason),
            "stop_sequence": stop_sequence(self._last),
        }
        end = {"type": "message_delta", "delta": delta, "usage": usage(chat_usage)}
        return self._close() + [event("message_delta", end), event("message_stop", {"type": "message_stop"})]

    def error(self, e: ApiError) -> list[bytes]:
        """A failure after the stream began: Anthropic's error event ends it."""
        return [event("error", error_body(e))]
