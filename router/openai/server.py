"""The OpenAI-compatible HTTP API: aiohttp's server in the router's own event loop, a thin layer over the
same Frontend as the gRPC servicer (router/grpc_api.py).

Each handler decodes its body (protocol.py, tokenize.py), calls the Frontend, and encodes what comes out as
one JSON answer or as server-sent events (encoder.py). Validation, admission, buckets, metrics and tracing
are the Frontend's, so they are the same on both APIs. Besides OpenAI's endpoints it serves vLLM's
(/tokenize, /detokenize, /version, /ping) and the router's /metrics, so clients written for vLLM find them.

The first response is awaited before anything is sent: validation and admission fail there, so a bad
request is a 400 and a full queue a 429 even when streaming. A failure after the first event can only
travel as an event: `data: {"error": {...}}`, then `data: [DONE]`.

A client that goes away must not keep its KV blocks: the runner cancels a handler whose connection is
lost (handler_cancellation), the cancellation reaches the Frontend's generator where it waits for the
next token, and its `finally` aborts the request; a write that fails closes the generator the same way
(contextlib.aclosing).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import math
import os
import ssl
import uuid
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common import tracing
from common.grpc_util import MAX_MESSAGE_BYTES
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.security import TlsFiles
from router.anthropic.server import ERROR_SHAPE as anthropic_errors
from router.anthropic.server import AnthropicApi
from router.auth import CALLER_AUTHORIZATION, ApiKeys, refusal
from router.frontend import Frontend, RequestFailed
from router.openai import lora, protocol, tokenize
from router.openai.answer import Answer, started, write_events
from router.openai.errors import ApiError, bad_request, from_failure
from router.openai.responses_server import ResponsesApi

log = logging.getLogger("tpserve.router")

# Probes, the version and the metrics need no key (as gRPC health and the --metrics-port); everything that
# makes the server work (generating, tokenizing) does.
EXEMPT_PATHS = ("/health", "/ping", "/version", "/metrics")


def ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """The public port's TLS (the same files as gRPC's); with tls.ca, clients must present certificates."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        ctx.load_verify_locations(tls.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _error(e: ApiError, body: dict) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    if e.retry_after_s is not None:  # RFC 9110: whole seconds
        headers = {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}
    return web.json_response(body, status=e.status, headers=headers)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _version() -> str:
    try:
        return importlib.metadata.version("tpserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


class OpenAIServer:
    def __init__(
        self,
        frontend: Frontend,
        *,
        keys: ApiKeys | None = None,
        on_refused: Callable[[], None] = lambda: None,
        tls: TlsFiles | None = None,
        drain_timeout_s: float = 30.0,
        metrics_registry=None,
        tool_call_parser: str | None = None,
        strict_schemas: bool = True,
        responses_store_size: int = 1000,
    ):
        """strict_schemas: --disable-additional-properties (JSON Schemas closed unless a request says);
        responses_store_size: --responses-store-size (the Responses API's stored responses)."""
        self.frontend = frontend
        self.keys = keys
        self.on_refused = on_refused
        self.tls = tls
        self.draining = False
        self.metrics_registry = metrics_registry
        self.tool_call_parser = tool_call_parser
        self.strict_schemas = strict_schemas
        # Any path naming the served directory is the served model (resolved once: it does not move).
        self._model_path = os.path.realpath(frontend.config.model)
        self._served_names = frontend.config.served_model_name  # --served-model-name: all accepted
        # Token-id prompts of long contexts are megabytes: the same bound as gRPC messages.
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=MAX_MESSAGE_BYTES)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/health", self.health),
                web.get("/ping", self.health),
                web.post("/ping", self.health),
                web.get("/version", self.version),
                web.get("/metrics", self.metrics),
                web.post("/v1/load_lora_adapter", self.load_lora_adapter),
                web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
            ]
        )
        # The other APIs over the same path: each registers its routes, and the error shape of its paths.
        self.apis = [AnthropicApi(self), ResponsesApi(self, responses_store_size)]
        for api in self.apis:
            app.add_routes(api.routes())
        self._error_shapes = [anthropic_errors]
        self.app = app
        self._runner = web.AppRunner(
            # Past the drain timeout the router ends what is left with FINISH_REASON_ABORTED (pool.drain):
            # a few seconds more for those last messages.
            app,
            handler_cancellation=True,
            shutdown_timeout=drain_timeout_s + 5.0,
            access_log=None,
        )

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: any free port); returns the bound port."""
        await self._runner.setup()
        tls = ssl_context(self.tls) if self.tls is not None else None
        site = web.TCPSite(self._runner, host, port, ssl_context=tls)
        await site.start()
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Drain: /health turns 503, new requests get 503, requests in flight may finish within
        drain_timeout_s (then they are cancelled, which aborts them)."""
        self.draining = True
        await self._runner.cleanup()

    # ---- middlewares ----

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return _error(e, self._error_body(request, e))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            # aiohttp's own refusals (unknown path, wrong method, body too large) in the API's shape too.
            e = ApiError(e.status, f"{request.method} {request.path}: {e.reason}")
            return _error(e, self._error_body(request, e))

    def _error_body(self, request: web.Request, e: ApiError) -> dict:
        shape = next((shape for prefix, shape in self._error_shapes if request.path.startswith(prefix)), None)
        return e.body() if shape is None else shape(e)

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        presented = [("authorization", v) for v in request.headers.getall("Authorization", [])]
        presented += [("x-api-key", v) for v in request.headers.getall("X-Api-Key", [])]  # Anthropic's
        CALLER_AUTHORIZATION.set(tuple(presented))  # who calls, for what it may ask (router/objectives.py)
        if self.keys is not None and request.path not in EXEMPT_PATHS:
            message = refusal(self.keys, presented)
            if message is not None:
                self.on_refused()
                raise ApiError(401, message, code="UNAUTHENTICATED")  # the message holds no key
        return await handler(request)

    # ---- endpoints ----

    async def health(self, request: web.Request) -> web.Response:
        serving = self.frontend.pool.ready and not self.draining
        return web.json_response(
            {"status": "SERVING" if serving else "NOT_SERVING"}, status=200 if serving else 503
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _version()})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.metrics_registry is None:
            raise ApiError(404, "this server has no metrics")
        # Off the loop: the collectors read the loop's state through the loop itself (router/server.py
        # on_loop), which would wait forever on a loop busy running them.
        text = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.metrics_registry)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _card(self, info: pb.ModelInfo) -> dict:
        return {
            "id": info.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tpserve",
            "root": self.frontend.config.model,  # vLLM's: where the weights come from
            "parent": None,
            "max_model_len": info.max_model_len,
        }

    def _lora_card(self, info: pb.ModelInfo, name: str) -> dict:
        # vLLM's shape: an adapter is a model of its own whose parent is the base model.
        return self._card(info) | {
            "id": name,
            "root": self.frontend.loras.path(name),
            "parent": info.model_name,
        }

    async def models(self, request: web.Request) -> web.Response:
        info = self._model_info()
        cards = [self._card(info)] + [self._lora_card(info, n) for n in self.frontend.loras.names()]
        return web.json_response({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await lora.load(self.frontend, await self.body(request))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await lora.unload(self.frontend, await self.body(request))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name in self.frontend.loras:
            return web.json_response(self._lora_card(self._model_info(), name))
        return web.json_response(self._card(self.check_model(name)))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(
            request, lambda body, rid: protocol.parse_completion(body, rid, self.strict_schemas)
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(
            request,
            lambda body, rid: protocol.parse_chat(body, rid, self.tool_call_parser, self.strict_schemas),
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        req = tokenize.parse_tokenize(await self.body(request))
        self.check_model(req.model)
        try:
            ids, strs, max_model_len = await self.frontend.tokenize(req.generate, req.return_token_strs)
        except RequestFailed as e:
            raise from_failure(e, {"text": "prompt"}) from None
        return web.json_response(tokenize.tokenize_response(ids, max_model_len, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        model, ids = tokenize.parse_detokenize(await self.body(request))
        self.check_model(model)
        try:
            return web.json_response({"prompt": await self.frontend.detokenize(ids)})
        except RequestFailed as e:
            raise from_failure(e, {}) from None

    # ---- the path ----

    def _model_info(self) -> pb.ModelInfo:
        try:
            return self.frontend.model_info()
        except RequestFailed as e:
            raise from_failure(e, {}) from None

    def check_model(self, name: str | None) -> pb.ModelInfo:
        """The served model, or 404 for another name. Its name (as /v1/models lists it) and any path to the
        directory the router was given (--model) are the served model."""
        info = self._model_info()
        if name is None or name in (info.model_name, self.frontend.config.model, *self._served_names):
            return info
        if os.sep in name and os.path.realpath(name) == self._model_path:
            return info
        raise ApiError(
            404,
            f"The model `{name}` does not exist (this server serves `{info.model_name}`)",
            param="model",
            code="NOT_FOUND",
        )

    async def body(self, request: web.Request) -> object:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="UNAVAILABLE")
        try:
            return await request.json()
        except ValueError as e:
            raise bad_request(None, f"the request body is not valid JSON: {e}") from None

    def served_name(self, req: protocol.ApiRequest) -> str:
        """The name answers carry: an adapter's (which the request then runs on, as vLLM's), else the served
        model's (404 for another)."""
        if req.model in self.frontend.loras:
            for g in req.generates:
                g.lora_name = req.model
            return req.model
        return self.check_model(req.model).model_name

    @contextlib.asynccontextmanager
    async def answer(self, request: web.Request, req: protocol.ApiRequest) -> AsyncIterator[Answer]:
        """req started through the Frontend (answer.py), for any of the APIs to render."""
        name = self.served_name(req)
        parent = tracing.context_from_metadata((k.lower(), v) for k, v in request.headers.items())
        reasoning = self.frontend.config.reasoning_parser is not None
        async with started(self.frontend, req, name, self.tool_call_parser, parent, reasoning) as a:
            yield a

    @staticmethod
    def request_id(request: web.Request) -> str:
        return request.headers.get("X-Request-Id") or uuid.uuid4().hex

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        req = parse(await self.body(request), self.request_id(request))
        async with self.answer(request, req) as a:
            if req.stream:
                return await write_events(request, _chunks(a), a.encoder.id)
            whole = [resp async for resp in a.responses()]
            if req.best_of is not None:
                whole = best_of(whole, req.best_of, req.n)
            return web.json_response(a.encoder.whole(whole))


async def _chunks(a: Answer) -> AsyncIterator[bytes]:
    """A completions or chat stream: OpenAI's chunks, a failure as an error chunk, then [DONE]."""
    if a.req.chat:
        for chunk in a.encoder.role_chunks():
            yield _sse(chunk)
    usage = None
    try:
        async for resp, chunk in a.chunks():
            if chunk is not None:
                yield _sse(chunk)
            if resp.HasField("usage"):  # the very last message: every choice has finished
                usage = resp.usage
    except ApiError as e:
        yield _sse(e.body())
    if a.req.include_usage and usage is not None:
        yield _sse(a.encoder.usage_chunk(usage))
    yield b"data: [DONE]\n\n"


def best_of(responses: list[pb.GenerateResponse], generated: int, n: int) -> list[pb.GenerateResponse]:
    """best_of: of each prompt's `generated` choices, the n whose tokens' summed logprob is highest (vLLM's
    rule), renumbered p * n + rank in that order."""
    score: dict[int, float] = {}
    for resp in responses:
        score[resp.index] = score.get(resp.index, 0.0) + sum(lp.chosen.logprob for lp in resp.logprobs)
    new_index = {}
    for p in range(max(score, default=-1) // generated + 1):
        ranked = sorted(range(p * generated, (p + 1) * generated), key=lambda i: -score.get(i, float("-inf")))
        new_index |= {i: p * n + rank for rank, i in enumerate(ranked[:n])}
    kept = [r for r in responses if r.index in new_index]
    total = next((r.usage for r in responses if r.HasField("usage")), None)
    for r in kept:
        r.index = new_index[r.index]
        r.ClearField("usage")
    if kept and total is not None:  # the usage counts every choice generated, as vLLM's does
        kept[-1].usage.CopyFrom(total)
    return kept
