"""The path every public API shares: validate and tokenize a GenerateRequest, queue it for a replica, and
stream back its tokens as text (incremental detokenization, stop strings), with metrics and a span.

The gRPC servicer (router/grpc_api.py) and the OpenAI-compatible HTTP API (router/openai_api.py) only
decode their request into a GenerateRequest, iterate `Frontend.generate`, and encode what comes out; a
failure is a RequestFailed carrying the gRPC status, which each API turns into its own error shape in
one place. A request whose caller goes away (the generator is closed) is aborted and its KV freed.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from common import tracing
from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.v1 import generation_pb2
from common.sampling import SamplingConfig
from router.config import RouterConfig
from router.detokenizer import IncrementalDetokenizer
from router.metrics import RouterMetrics
from router.pool import SchedulerPool
from router.scheduler_link import QueueFull, SchedulerUnavailable
from router.stop_strings import StopStringMatcher
from router.tokenizer import NoChatTemplate, NoTokenizer, Tokenizer
from router.validation import Limits, ValidatedRequest, ValidationError, prompt_field, validate_request

log = logging.getLogger("tpserve.router")

FINISH_STOP = generation_pb2.FINISH_REASON_STOP
# The internal ErrorCode's values are gRPC's own (see scheduler.proto).
STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}


class RequestFailed(Exception):
    """The status a request ends with. field: the request field at fault (INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class Frontend:
    def __init__(
        self, config: RouterConfig, tokenizer: Tokenizer, pool: SchedulerPool, metrics: RouterMetrics
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool  # every replica, behind one admission queue
        self.metrics = metrics
        self._tracer = tracing.tracer("tpserve.router")
        self._limits: Limits | None = None
        self._sampling_defaults = SamplingConfig.model_defaults(config.model)

    # ---- what the APIs call ----

    def model_info(self) -> generation_pb2.ModelInfo:
        info = self.pool.model_info
        if info is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the scheduler has not reported yet")
        return info

    async def stats(self) -> generation_pb2.Stats:
        try:
            stats = await self.pool.stats()
        except SchedulerUnavailable as e:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"GetStats: {e}") from None
        admission = self.pool.admission
        stats.num_waiting += len(admission)
        for b in admission.stats(time.monotonic()):
            stats.buckets.add(
                name=b.name,
                lower=b.lower,
                upper=b.upper or 0,
                waiting=b.waiting,
                oldest_wait_seconds=b.oldest_wait_s,
            )
        return stats

    async def generate(
        self, request: generation_pb2.GenerateRequest, parent=None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request's responses, its last one with finish_reason and usage. Raises RequestFailed.
        parent: the caller's trace context (W3C traceparent), if any."""
        start = time.perf_counter()
        span = self._tracer.start_span("tpserve.Generate", context=parent, kind=SpanKind.SERVER)
        try:
            # Closing this generator (the caller went away) closes the inner one at once, whose cleanup
            # aborts the request, rather than leaving that to the event loop's finalizer.
            async with contextlib.aclosing(self._generate(request, span, start)) as responses:
                async for resp in responses:
                    yield resp
        except RequestFailed as e:
            self.metrics.failed.labels(code=e.code.name).inc()
            span.set_status(Status(StatusCode.ERROR, f"{e.code.name}: {e.message}"))
            raise
        finally:
            span.end()

    # ---- the path ----

    def _ready_limits(self) -> Limits:
        info = self.pool.model_info
        if not self.pool.accepting or info is None:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE, "the server is starting or its shards are unavailable"
            )
        if self._limits is None or self._limits.max_model_len != info.max_model_len:
            cfg = self.config
            self._limits = Limits(
                vocab_size=info.vocab_size,
                max_model_len=info.max_model_len,
                # A cap at or above what the model allows is no cap.
                max_prompt_tokens=cfg.max_prompt_tokens
                if 0 < cfg.max_prompt_tokens < info.max_model_len
                else None,
                max_new_tokens=cfg.max_new_tokens_limit or None,
                default_max_new_tokens=cfg.default_max_new_tokens,
                sampling_defaults=self._sampling_defaults,
            )
        return self._limits

    async def _validate(self, request: generation_pb2.GenerateRequest) -> ValidatedRequest:
        limits = self._ready_limits()
        tok = self.tokenizer
        try:
            if len(request.token_ids):  # nothing to tokenize: cheap enough for the event loop
                return validate_request(request, limits)
            # The fields are checked first (they bound what the tokenizer is asked to do), then the
            # prompt is tokenized and checked: all of it on the tokenizer's threads, off the event loop.
            return await tok.run(validate_request, request, limits, tok.encode, tok.render_chat)
        except ValidationError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
        except NoChatTemplate as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), "messages") from None
        except NoTokenizer as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), prompt_field(request)) from None

    async def _generate(self, request, span, start: float):
        req = await self._validate(request)
        request_id = req.request_id or uuid.uuid4().hex
        span.set_attributes(
            {"tpserve.request_id": request_id, "tpserve.prompt_tokens": len(req.prompt_token_ids)}
        )
        if self.pool.in_flight(request_id):
            raise RequestFailed(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight"
            )
        add = scheduler_pb2.AddRequest(
            request_id=request_id,
            prompt_token_ids=req.prompt_token_ids,
            max_new_tokens=req.max_new_tokens,
            sampling=req.sampling.to_proto(),
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            top_logprobs=req.top_logprobs,
            trace_context=tracing.carrier(span),
        )
        try:
            queue = self.pool.submit(add)
        except SchedulerUnavailable as e:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except QueueFull as e:
            limit = self.config.admission.max_queued_requests
            raise RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e} (the limit: --max-queued-requests {limit})"
            ) from None

        detok = IncrementalDetokenizer(self.tokenizer, list(req.prompt_token_ids))
        stops = StopStringMatcher(req.stop) if req.stop else None
        num_generated = 0
        first_token_at = last_token_at = None
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if out.error:
                    finished = True
                    raise RequestFailed(
                        STATUS_BY_CODE.get(out.error_code, grpc.StatusCode.INTERNAL), out.error
                    )
                now = time.perf_counter()
                if first_token_at is None:
                    first_token_at = now
                    self.metrics.ttft.observe(now - start)
                else:
                    self.metrics.itl.observe(now - last_token_at)
                last_token_at = now
                num_generated += len(out.token_ids)
                text = detok.push(list(out.token_ids))
                reason = out.finish_reason
                if reason:
                    text += detok.flush()
                stopped = False
                if stops is not None:
                    text, stopped = stops.feed(text)
                    if stopped:
                        reason = FINISH_STOP
                    elif reason:
                        text += stops.flush()
                resp = generation_pb2.GenerateResponse(
                    request_id=request_id, token_ids=out.token_ids, text=text, finish_reason=reason
                )
                for lp in out.logprobs:
                    resp.logprobs.append(self._with_text(lp))
                if reason:
                    finished = True
                    resp.usage.CopyFrom(
                        generation_pb2.Usage(
                            prompt_tokens=len(req.prompt_token_ids),
                            completion_tokens=num_generated,
                            cached_tokens=out.cached_tokens,
                        )
                    )
                    if stopped:
                        self.pool.abort(request_id)
                    else:
                        self.pool.done(request_id)
                    self._record_finish(
                        span, request_id, req, reason, num_generated, start, first_token_at, now
                    )
                yield resp
        finally:
            if not finished:
                # Cancelled, disconnected or past its deadline: free its KV blocks now.
                self.pool.abort(request_id)
                span.add_event("cancelled")

    def _record_finish(
        self, span, request_id, req, reason, num_generated, start, first_token_at, now
    ) -> None:
        m = self.metrics
        name = generation_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
        e2e = now - start
        m.e2e.observe(e2e)
        if num_generated > 1:
            m.tpot.observe((now - first_token_at) / (num_generated - 1))
        m.prompt_len.observe(len(req.prompt_token_ids))
        m.generation_len.observe(num_generated)
        m.prompt_tokens.inc(len(req.prompt_token_ids))
        m.generation_tokens.inc(num_generated)
        m.finished.labels(reason=name).inc()
        span.set_attributes({"tpserve.completion_tokens": num_generated, "tpserve.finish_reason": name})
        log.info(
            "request finished",
            extra={
                "request_id": request_id,
                "trace_id": format(span.get_span_context().trace_id, "032x"),
                "finish_reason": name,
                "prompt_tokens": len(req.prompt_token_ids),
                "completion_tokens": num_generated,
                "ttft_s": round(first_token_at - start, 6),
                "e2e_s": round(e2e, 6),
            },
        )

    def _with_text(self, lp: generation_pb2.Logprobs) -> generation_pb2.Logprobs:
        lp.chosen.text = self.tokenizer.decode([lp.chosen.token_id])
        for t in lp.top:
            t.text = self.tokenizer.decode([t.token_id])
        return lp
