"""POST /v1/messages and /v1/messages/count_tokens on the HTTP server (router/openai/server.py), which gives
them its keys (x-api-key too), body reading, model check and request path (router/openai/answer.py).
Errors, before the stream or within it, are Anthropic's: {"type": "error", "error": {"type", "message"}}
(the server's error middleware renders every path under PREFIX that way)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from router.anthropic.encoder import MessageStream, error_body, message
from router.anthropic.protocol import parse_count_tokens, parse_messages, renamed
from router.frontend import RequestFailed
from router.openai.answer import Answer, write_events
from router.openai.errors import ApiError, from_failure

if TYPE_CHECKING:
    from router.openai.server import OpenAIServer

PREFIX = "/v1/messages"
ERROR_SHAPE = (PREFIX, lambda e: error_body(renamed(e)))


class AnthropicApi:
    def __init__(self, server: OpenAIServer):
        self.server = server

    def routes(self) -> list[web.RouteDef]:
        return [web.post(PREFIX, self.messages), web.post(f"{PREFIX}/count_tokens", self.count_tokens)]

    async def messages(self, request: web.Request) -> web.StreamResponse:
        s = self.server
        req = parse_messages(
            await s.body(request), s.request_id(request), s.tool_call_parser, s.strict_schemas
        )
        message_id = "msg_" + req.generate.request_id
        async with s.answer(request, req) as a:
            if req.stream:
                events = _events(a, MessageStream(message_id, a.encoder.model))
                return await write_events(request, events, message_id)
            responses = [resp async for resp in a.responses()]
            whole = a.encoder.whole(responses)
            return web.json_response(message(whole, message_id, responses[-1]))

    async def count_tokens(self, request: web.Request) -> web.Response:
        s = self.server
        body = await s.body(request)
        generate = parse_count_tokens(body)
        s.check_model(body.get("model"))
        try:
            ids, _, _ = await s.frontend.tokenize(generate)
        except RequestFailed as e:
            raise from_failure(e, {}) from None
        return web.json_response({"input_tokens": len(ids)})


async def _events(a: Answer, stream: MessageStream) -> AsyncIterator[bytes]:
    for e in stream.start():
        yield e
    usage = None
    try:
        async for resp, chunk in a.chunks():
            for e in stream.feed(resp, chunk):
                yield e
            if resp.HasField("usage"):
                usage = a.encoder.usage_chunk(resp.usage)["usage"]
    except ApiError as failure:
        for e in stream.error(renamed(failure)):
            yield e
        return
    for e in stream.finish(usage):
        yield e
