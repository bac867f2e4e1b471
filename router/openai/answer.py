"""One request on its way through the Frontend, as every HTTP API reads it: started (the tool-call parser
chosen, the first response awaited, so a bad request or a full queue fails before anything is sent), then
read as chat completion chunks or as the whole chat answer (encoder.py).

The chat completions endpoint writes those chunks as they are; the Anthropic Messages API
(router/anthropic/) and the Responses API (responses.py) render the same chunks as their own events. So
sampling, tools, structured outputs, stop strings and the tool-call parsers exist once, under all three.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.choices import merged
from router.frontend import Frontend, RequestFailed
from router.openai.encoder import Encoder
from router.openai.errors import from_failure
from router.openai.protocol import ApiRequest
from router.openai.tool_parsers import PARSERS, ForcedCalls
from router.openai.tools import FUNCTION, REQUIRED

log = logging.getLogger("tpserve.router")


class Answer:
    """A started request: its chat encoder and its responses, the first one already in hand."""

    def __init__(
        self,
        req: ApiRequest,
        encoder: Encoder,
        first: pb.GenerateResponse,
        rest: AsyncIterator[pb.GenerateResponse],
    ):
        self.req = req
        self.encoder = encoder
        self._first: pb.GenerateResponse | None = first
        self._rest = rest

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """Every response in order; a failure after the first is an ApiError."""
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        try:
            async for resp in self._rest:
                yield resp
        except RequestFailed as e:
            raise from_failure(e, self.req.params) from None

    async def chunks(self) -> AsyncIterator[tuple[pb.GenerateResponse, dict | None]]:
        """Each response with its chat completion chunk (None: nothing to say yet, text held back)."""
        async for resp in self.responses():
            yield resp, self.encoder.chunk(resp)


def _tool_parser(req: ApiRequest, tool_call_parser: str | None):
    choice = req.tool_choice
    if choice is not None and choice.mode in (REQUIRED, FUNCTION):
        return functools.partial(ForcedCalls, choice.name)  # the answer is the call, made by its grammar
    if choice is not None and choice.parses:
        parser = PARSERS[tool_call_parser]
        if parser.needs_special_tokens and not req.generate.HasField("skip_special_tokens"):
            req.generate.skip_special_tokens = False  # the parser's marker is a special token
        return parser
    return None


@contextlib.asynccontextmanager
async def started(
    frontend: Frontend,
    req: ApiRequest,
    model: str,
    tool_call_parser: str | None,
    parent=None,
    reasoning: bool = False,
) -> AsyncIterator[Answer]:
    """req started on the Frontend, as `model` (the name answers carry); leaving aborts what is still
    running. parent: the caller's trace context; reasoning: the server's reasoning parser splits answers."""
    parser = _tool_parser(req, tool_call_parser)
    echo_texts = await _echo_texts(frontend, req)
    encoder = Encoder(req, model, tool_parser=parser, echo_texts=echo_texts, reasoning=reasoning)
    async with contextlib.aclosing(_responses(frontend, req, parent)) as responses:
        try:
            first = await anext(responses)
        except RequestFailed as e:
            raise from_failure(e, req.params) from None
        yield Answer(req, encoder, first, responses)


def _responses(frontend: Frontend, req: ApiRequest, parent) -> AsyncIterator[pb.GenerateResponse]:
    """Every prompt's choices in one stream, choice i of prompt p as index p * n + i (the Frontend
    numbers each prompt's own from 0)."""
    generated = req.best_of or req.n

    async def numbered(p: int, g: pb.GenerateRequest):
        async with contextlib.aclosing(frontend.generate(g, parent)) as responses:
            async for resp in responses:
                resp.index += p * generated
                yield resp

    streams = [numbered(p, g) for p, g in enumerate(req.generates)]
    return merged(streams, same_prompt=len(streams) == 1, finishes=generated * len(streams))


async def _echo_texts(frontend: Frontend, req: ApiRequest) -> list[str] | None:
    """echo: each prompt's text (completions), or the last message's when it is the assistant's turn
    being continued (chat, as vLLM)."""
    if not req.echo:
        return None
    if req.chat:
        last = req.generate.messages[-1]
        return [last.content if last.role == "assistant" else ""]
    texts = []
    for g in req.generates:
        if g.text:
            texts.append(g.text)
            continue
        try:
            texts.append(await frontend.detokenize(list(g.token_ids)))
        except RequestFailed as e:
            raise from_failure(e, req.params) from None
    return texts


async def write_events(request: web.Request, events: AsyncIterator[bytes], name: str) -> web.StreamResponse:
    """Server-sent events as they come. A client that goes away between them closes `events` (and so the
    answer under it, which aborts the request)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async with contextlib.aclosing(events) as each:
            async for data in each:
                await response.write(data)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client of %s disconnected", name)
    return response
