"""One request's GenerateResponses as OpenAI's objects: stream chunks, or the whole answer.

Each response belongs to a choice (GenerateResponse.index: n choices per prompt, prompt after prompt), and
each choice keeps its own state: its text offset, its tool-call parser, whether it has started. With a
tool-call parser the chat text goes through it: content deltas and `tool_calls` deltas (each call whole,
with its index, id, name and arguments), and finish_reason "tool_calls" once a call was made, as vLLM
answers ("length" for a forced call that max_tokens cut: its arguments are a JSON prefix). `echo` puts
the prompt's text (and, with logprobs, the prompt's logprobs, the first token's null) before a
completion's own; vLLM's `prompt_logprobs` come as its {token id: {logprob, rank, decoded_token}} per
prompt position, the first null.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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


def usage(u: pb.Usage, reasoning: bool = False) -> dict:
    """reasoning: a reasoning parser ran (OpenAI's completion_tokens_details.reasoning_tokens)."""
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
    if reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return out


def _reasoning(text: str | None) -> dict:
    # vLLM's field, and its older name that clients written for it still read.
    return {"reasoning": text, "reasoning_content": text}


def _logprob(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _chat_logprob(t: pb.TokenLogprob) -> dict:
    # bytes: the token text's UTF-8 (a token ending inside a character has U+FFFD there, not its byte)
    return {"token": t.text, "logprob": _logprob(t.logprob), "bytes": list(t.text.encode())}


def _tool_call(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index} | out


def prompt_logprobs(entries: Iterable[pb.Logprobs]) -> list[dict | None]:
    """vLLM's prompt_logprobs from GenerateResponse.prompt_logprobs (one entry per prompt token): None for
    the first token, then per position the prompt token and its alternatives, each {logprob, rank,
    decoded_token}, keyed by token id (a string, as JSON keys are)."""
    out: list[dict | None] = []
    for i, lp in enumerate(entries):
        if i == 0:  # the first prompt token: nothing before it to be predicted from
            out.append(None)
            continue
        tokens = {}
        for t in (lp.chosen, *lp.top):
            tokens[str(t.token_id)] = {
                "logprob": _logprob(t.logprob),
                "rank": t.rank,
                "decoded_token": t.text,
            }
        out.append(tokens)
    return out


@dataclass
class _Choice:
    parser: ToolParser | None
    text_offset: int = 0  # completions' logprobs.text_offset, across chunks
    calls_sent: int = 0
    started: bool = False  # its first chunk went out (with the echo, the prompt logprobs)
    done: Completion = field(default_factory=Completion)


class Encoder:
    def __init__(
        self,
        req: ApiRequest,
        model: str,
        created: int | None = None,
        tool_parser: Callable[[], ToolParser] | None = None,
        echo_texts: list[str] | None = None,
        reasoning: bool = False,
    ):
        """tool_parser: makes each choice's parser; echo_texts: the text of each prompt (echo); reasoning:
        the server's reasoning parser splits this chat's answers (GenerateResponse.reasoning_text)."""
        self.req = req
        self.reasoning = reasoning and req.chat
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + req.generate.request_id
        self._new_parser = tool_parser
        self._choices: dict[int, _Choice] = {}
        self._echo = echo_texts
        # parallel_tool_calls false: the first call only.
        self._max_calls = 1 if req.tool_choice is not None and not req.tool_choice.parallel else None

    def _choice(self, index: int) -> _Choice:
        if index not in self._choices:
            self._choices[index] = _Choice(self._new_parser() if self._new_parser is not None else None)
        return self._choices[index]

    def _object(self, kind: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(
        self, c: _Choice, lps: Iterable[pb.Logprobs], prompt: Iterable[pb.Logprobs] = ()
    ) -> dict | None:
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
        tokens, values, tops, offsets = [], [], [], []
        for i, lp in enumerate([*prompt, *lps]):
            offsets.append(c.text_offset)
            c.text_offset += len(lp.chosen.text)
            tokens.append(lp.chosen.text)
            # Echo: the prompt's first token has nothing before it to be predicted from.
            first = i == 0 and bool(prompt)
            values.append(None if first else _logprob(lp.chosen.logprob))
            tops.append(None if first else {t.text: _logprob(t.logprob) for t in lp.top[:k]})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _parse(self, c: _Choice, text: str, final: bool) -> Parsed:
        """The text through the choice's tool-call parser (when there is one), keeping the first call only
        when parallel_tool_calls is false."""
        if c.parser is None:
            return Parsed(content=text)
        out = c.parser.feed(text)
        if final:
            out += c.parser.finish()
        if self._max_calls is not None:
            out.calls = out.calls[: max(0, self._max_calls - c.calls_sent)]
        return out

    def _finish_reason(self, c: _Choice, resp_reason: int) -> str | None:
        """ "tool_calls" once a call was made, unless the answer stopped inside one (a forced call cut by
        max_tokens): that keeps its own reason, so a client knows the arguments are incomplete."""
        finish = FINISH_REASONS.get(resp_reason)
        if finish is None or not c.calls_sent or (c.parser is not None and c.parser.cut):
            return finish
        return "tool_calls"

    def _start(self, c: _Choice, index: int, resp: pb.GenerateResponse) -> tuple[str, dict, list]:
        """What a choice's first chunk adds: the echoed prompt, vLLM's prompt_logprobs field (completions),
        and the prompt's logprobs to put before the choice's own (echo with logprobs)."""
        if c.started:
            return "", {}, []
        c.started = True
        text = self._echo[index // self.req.n] if self._echo is not None else ""
        extra = {}
        if self.req.prompt_logprobs is not None and not self.req.chat:
            extra["prompt_logprobs"] = prompt_logprobs(resp.prompt_logprobs)
        echoed = list(resp.prompt_logprobs) if self._echo is not None and not self.req.chat else []
        return text, extra, echoed

    # -- streaming --

    def role_chunks(self) -> list[dict]:
        """A chat stream's first chunks: who speaks, for each choice."""
        delta = {"role": "assistant", "content": ""}
        return [
            self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            for i in range(self.req.num_choices)
        ]

    def chunk(self, resp: pb.GenerateResponse) -> dict | None:
        """The chunk for one response; None when it has nothing to say (text held back, no logprobs)."""
        c = self._choice(resp.index)
        if not self.req.chat:
            head, extra, echoed = self._start(c, resp.index, resp)
            logprobs = self._logprobs(c, resp.logprobs, echoed) if resp.logprobs or echoed else None
            if not head and not resp.text and not resp.finish_reason and logprobs is None and not extra:
                return None
            finish = FINISH_REASONS.get(resp.finish_reason)
            choice = {
                "index": resp.index,
                "text": head + resp.text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            return self._chunk([choice | extra])
        logprobs = self._logprobs(c, resp.logprobs) if resp.logprobs else None
        head, _, _ = self._start(c, resp.index, resp)
        parsed = self._parse(c, resp.text, final=bool(resp.finish_reason))
        content = head + parsed.content
        delta = _reasoning(resp.reasoning_text) if resp.reasoning_text else {}
        if content:
            delta["content"] = content
        if parsed.calls:
            delta["tool_calls"] = [_tool_call(call, c.calls_sent + i) for i, call in enumerate(parsed.calls)]
            c.calls_sent += len(parsed.calls)
        if not delta and not resp.finish_reason and logprobs is None:
            return None
        choice = {"index": resp.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        choice["finish_reason"] = self._finish_reason(c, resp.finish_reason)
        return self._chunk([choice])

    def usage_chunk(self, u: pb.Usage) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return self._chunk([]) | {"usage": usage(u, self.reasoning)}

    def _chunk(self, choices: list) -> dict:
        out = self._object("chat.completion.chunk" if self.req.chat else "text_completion", choices)
        if self.req.include_usage:
            out["usage"] = None  # as OpenAI: every chunk but the last has a null usage
        return out

    # -- the whole answer --

    def whole(self, responses: Iterable[pb.GenerateResponse]) -> dict:
        total = pb.Usage()
        prompt_lps: dict[int, list] = {}
        for resp in responses:
            self._choice(resp.index).done.add(resp)
            prompt_lps.setdefault(resp.index, []).extend(resp.prompt_logprobs)
            if resp.HasField("usage"):
                total = resp.usage
        choices = [self._whole_choice(i, prompt_lps[i]) for i in sorted(self._choices)]
        kind = "chat.completion" if self.req.chat else "text_completion"
        out = self._object(kind, choices) | {"usage": usage(total, self.reasoning)}
        if self.req.chat and self.req.prompt_logprobs is not None and choices:
            out["prompt_logprobs"] = prompt_logprobs(prompt_lps[min(self._choices)])  # vLLM: one, on top
        return out

    def _whole_choice(self, index: int, prompt_lps: list) -> dict:
        c = self._choices[index]
        done = c.done
        if not self.req.chat:
            head, extra, echoed = self._start(c, index, pb.GenerateResponse(prompt_logprobs=prompt_lps))
            logprobs = self._logprobs(c, done.logprobs, echoed)
            finish = FINISH_REASONS.get(done.finish_reason)
            return {
                "index": index,
                "text": head + done.text,
                "logprobs": logprobs,
                "finish_reason": finish,
            } | extra
        logprobs = self._logprobs(c, done.logprobs)
        head, _, _ = self._start(c, index, pb.GenerateResponse())
        message = {"role": "assistant", "content": head + done.text}
        if c.parser is not None:
            parsed = self._parse(c, done.text, final=True)
            c.calls_sent = len(parsed.calls)
            if parsed.calls:
                # As OpenAI: an answer that calls tools has a null content unless it also said something.
                message = {
                    "role": "assistant",
                    "content": parsed.content.strip() or None,
                    "tool_calls": [_tool_call(call) for call in parsed.calls],
                }
            else:
                message["content"] = head + parsed.content
        if self.reasoning:
            message |= _reasoning(done.reasoning or None)
            if done.reasoning and not message["content"]:
                message["content"] = None  # as vLLM: an answer cut inside its think block has no content
        choice = {"index": index, "message": message, "logprobs": logprobs}
        choice["finish_reason"] = self._finish_reason(c, done.finish_reason)
        return choice
