"""POST /v1/responses, GET and DELETE /v1/responses/{id} on the HTTP server (server.py), over its keys, body
reading, model check and request path (answer.py).

Stored responses (`store`, true unless a request says false, as OpenAI's default) live in this process's
memory only: the last --responses-store-size of them (least recently used out first), lost when the router
restarts, and each router of several keeps its own. A stored response keeps its conversation (the chat
messages, less instructions) so that previous_response_id continues it; one not stored, evicted or from
another router is a 404 naming previous_response_id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from router.openai.answer import Answer, write_events
from router.openai.errors import ApiError
from router.openai.responses import ResponsesRequest, parse_responses, renamed
from router.openai.responses_output import ResponseStream, Said, response, usage

if TYPE_CHECKING:
    from router.openai.server import OpenAIServer


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object, as GET returns it
    conversation: list[dict]  # its chat messages with the answer last, for previous_response_id


class ResponseStore:
    """The last `size` stored responses by id, least recently used out first (0: none kept)."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> Stored | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: Stored) -> None:
        if self.size <= 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"No response with id {response_id!r} is stored on this server (responses live in one router's "
        "memory, the most recent --responses-store-size of them, until it restarts)",
        param=param,
        code="NOT_FOUND",
    )


class ResponsesApi:
    def __init__(self, server: OpenAIServer, store_size: int):
        self.server = server
        self.store = ResponseStore(store_size)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/responses", self.create),
            web.get("/v1/responses/{id}", self.retrieve),
            web.delete("/v1/responses/{id}", self.delete),
        ]

    async def retrieve(self, request: web.Request) -> web.Response:
        stored = self.store.get(request.match_info["id"])
        if stored is None:
            raise _not_found(request.match_info["id"])
        return web.json_response(stored.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["id"]
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        s = self.server
        body = await s.body(request)
        history = []
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is not None:
            stored = self.store.get(previous) if isinstance(previous, str) else None
            if stored is None:
                raise _not_found(str(previous), "previous_response_id")
            history = stored.conversation
        r = parse_responses(body, s.request_id(request), history, s.tool_call_parser, s.strict_schemas)
        try:
            async with s.answer(request, r.req) as a:
                stream = ResponseStream(r.req.generate.request_id, a.encoder.model, r.echo)
                if r.req.stream:
                    return await write_events(request, self._events(a, stream, r), stream.rid)
                responses = [resp async for resp in a.responses()]
                said = Said.of(a.encoder.whole(responses))
                last = responses[-1].usage
                chat_usage = a.encoder.usage_chunk(last)["usage"]
                whole = response(
                    stream.rid,
                    stream.model,
                    stream.created,
                    r.echo,
                    said,
                    usage(chat_usage, last.cached_tokens),
                )
                self._keep(r, whole, said)
                return web.json_response(whole)
        except ApiError as e:
            raise renamed(e) from None

    def _keep(self, r: ResponsesRequest, whole: dict, said: Said) -> None:
        if r.echo["store"]:
            self.store.put(whole["id"], Stored(whole, r.conversation + [said.assistant()]))

    async def _events(self, a: Answer, stream: ResponseStream, r: ResponsesRequest) -> AsyncIterator[bytes]:
        for e in stream.start():
            yield e
        totals = None
        try:
            async for resp, chunk in a.chunks():
                for e in stream.feed(chunk):
                    yield e
                if resp.HasField("usage"):
                    totals = usage(a.encoder.usage_chunk(resp.usage)["usage"], resp.usage.cached_tokens)
        except ApiError as failure:
            for e in stream.error(renamed(failure)):
                yield e
            return
        events, whole = stream.finish(totals)
        self._keep(r, whole, stream.said)
        for e in events:
            yield e
