"""One request's GenerateResponses as OpenAI's objects: stream chunks, or the whole answer.

With a tool-call parser (tool_choice "auto"), the chat text goes through it: content deltas and `tool_calls`
deltas (each call whole, with its index, id, name and arguments), and finish_reason "tool_calls" once a
call was made, as vLLM answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from common.client import Completion
from common.pb.tpserve.v1 import generation_pb2 as pb
from router.openai.protocol import ApiRequest
from router.openai.tool_parsers import Parsed, ToolCall, ToolParser

FINISH_REASONS = {
    pb.FINISH_REASON_EOS: "stop",  # OpenAI does not tell EOS from a stop sequence
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "abort",  # vLLM's name: the server ended it (shutting down)
}
# What JSON cannot hold (a logprob of -inf) is sent as OpenAI and vLLM send it.
MIN_LOGPROB = -9999.0


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


def _tool_call(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index} | out


class Encoder:
    def __init__(
        self, req: ApiRequest, model: str, created: int | None = None, tool_parser: ToolParser | None = None
    ):
        self.req = req
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + req.generate.request_id
        self._text_offset = 0  # completions' logprobs.text_offset, across chunks
        self._tools = tool_parser
        self._calls_sent = 0
        # parallel_tool_calls false: the first call only.
        self._max_calls = 1 if req.tool_choice is not None and not req.tool_choice.parallel else None

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

    def _parse(self, text: str, final: bool) -> Parsed:
        """The text through the tool-call parser (when there is one), keeping the first call only when
        parallel_tool_calls is false."""
        if self._tools is None:
            return Parsed(content=text)
        out = self._tools.feed(text)
        if final:
            out += self._tools.finish()
        if self._max_calls is not None:
            out.calls = out.calls[: max(0, self._max_calls - self._calls_sent)]
        return out

    def _finish_reason(self, resp_reason: int) -> str | None:
        finish = FINISH_REASONS.get(resp_reason)
        return "tool_calls" if finish is not None and self._calls_sent else finish

    # -- streaming --

    def role_chunk(self) -> dict:
        """A chat stream's first chunk: who speaks."""
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def chunk(self, resp: pb.GenerateResponse) -> dict | None:
        """The chunk for one response; None when it has nothing to say (text held back, no logprobs)."""
        logprobs = self._logprobs(resp.logprobs) if resp.logprobs else None
        if not self.req.chat:
            if not resp.text and not resp.finish_reason and logprobs is None:
                return None
            finish = FINISH_REASONS.get(resp.finish_reason)
            return self._chunk(
                [{"index": 0, "text": resp.text, "logprobs": logprobs, "finish_reason": finish}]
            )
        parsed = self._parse(resp.text, final=bool(resp.finish_reason))
        delta = {"content": parsed.content} if parsed.content else {}
        if parsed.calls:
            delta["tool_calls"] = [_tool_call(c, self._calls_sent + i) for i, c in enumerate(parsed.calls)]
            self._calls_sent += len(parsed.calls)
        if not delta and not resp.finish_reason and logprobs is None:
            return None
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        choice["finish_reason"] = self._finish_reason(resp.finish_reason)
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
        logprobs = self._logprobs(done.logprobs)
        if not self.req.chat:
            finish = FINISH_REASONS.get(done.finish_reason)
            choice = {"index": 0, "text": done.text, "logprobs": logprobs, "finish_reason": finish}
            return self._object("text_completion", [choice]) | {"usage": usage(done.usage or pb.Usage())}
        message = {"role": "assistant", "content": done.text}
        if self._tools is not None:
            parsed = self._parse(done.text, final=True)
            self._calls_sent = len(parsed.calls)
            if parsed.calls:
                # As OpenAI: an answer that calls tools has a null content unless it also said something.
                message = {
                    "role": "assistant",
                    "content": parsed.content.strip() or None,
                    "tool_calls": [_tool_call(c) for c in parsed.calls],
                }
            else:
                message["content"] = parsed.content
        choice = {"index": 0, "message": message, "logprobs": logprobs}
        choice["finish_reason"] = self._finish_reason(done.finish_reason)
        return self._object("chat.completion", [choice]) | {"usage": usage(done.usage or pb.Usage())}
