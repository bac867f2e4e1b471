"""API keys on the public port: `authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) or
UNAUTHENTICATED.

Keys are kept only as SHA-256 digests, and a presented key is hashed and compared with every one of them
with hmac.compare_digest, with no early exit: how long a check takes says nothing about how close a
guess came, nor which key matched, nor how long the keys are. Neither the keys nor what a client sent are
ever logged or echoed in a status message. The standard health service is exempt, so probes and load
balancers need no key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable
from contextvars import ContextVar

import grpc

log = logging.getLogger("tpserve.router")

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)

# The credentials the call being served presented, ("authorization" or "x-api-key", value) pairs, set
# where each API takes a call (the gRPC servicer, the HTTP auth middleware; each call is its own task, so
# its own context): what the rules that depend on the caller read (may_prioritize).
CALLER_AUTHORIZATION: ContextVar[tuple[tuple[str, str], ...]] = ContextVar("caller_authorization", default=())


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._digests = [_digest(k) for k in keys]
        if not self._digests:
            raise ValueError("at least one API key is required")

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys)"

    def check(self, presented: str) -> bool:
        digest = _digest(presented)
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(digest, d)  # no short cut: every key is compared every time
        return ok


def refusal(keys: ApiKeys, metadata) -> str | None:
    """Why a call with this metadata is refused (for its status message: never the key); None: allowed."""
    metadata = list(metadata or ())
    values = [v for k, v in metadata if k == "authorization"]
    # Anthropic's clients send the key bare in x-api-key; the same keys, checked the same way.
    bare = [v for k, v in metadata if k == "x-api-key"]
    if not values and not bare:
        return "missing `authorization: Bearer <key>` (or `x-api-key: <key>`) metadata"
    if len(values) + len(bare) > 1:
        return "more than one authorization or x-api-key header"
    if values:
        scheme, _, token = str(values[0]).strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the authorization metadata is not `Bearer <key>`"
    else:
        token = str(bare[0])
    if not token.strip() or not keys.check(token.strip()):
        return "the API key is not valid"
    return None


def may_prioritize(keys: ApiKeys | None) -> bool:
    """Whether the caller being served may ask a priority below the default: it presents one of keys
    (--priority-api-key-file), or the operator gave none."""
    if keys is None:
        return True
    return refusal(keys, CALLER_AUTHORIZATION.get()) is None


def _abort_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as the real one that only refuses the call."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    kwargs = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health's that lacks a valid key; on_refused() counts them (metrics)."""

    def __init__(self, keys: ApiKeys, on_refused: Callable[[], None] = lambda: None):
        self.keys = keys
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        message = refusal(self.keys, handler_call_details.invocation_metadata)
        if message is None:
            return handler
        self.on_refused()
        log.debug("refused %s: %s", handler_call_details.method, message)  # the message holds no key
        return _abort_handler(handler, message)
