"""The router process: the public Generation service.

Thin by design: validate and tokenize, hand the request to the replicas (router/pool.py), and turn the
token stream coming back into text (incremental detokenization, stop strings).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from common import metrics, security, tracing
from common.grpc_util import SERVER_OPTIONS, write_port_file
from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.v1 import generation_pb2, generation_pb2_grpc
from router.auth import ApiKeyInterceptor, ApiKeys
from router.buckets import AdmissionQueue
from router.config import RouterConfig
from router.detokenizer import IncrementalDetokenizer
from router.metrics import RouterMetrics
from router.pool import SchedulerPool
from router.scheduler_link import QueueFull, SchedulerUnavailable
from router.stop_strings import StopStringMatcher
from router.validation import Limits, ValidationError, validate_request

log = logging.getLogger("tpserve.router")

FINISH_STOP = generation_pb2.FINISH_REASON_STOP
# The internal ErrorCode's values are gRPC's own (see scheduler.proto).
STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, config: RouterConfig, tokenizer, link: SchedulerPool, metrics: RouterMetrics):
        self.config = config
        self.metrics = metrics
        self._tracer = tracing.tracer("tpserve.router")
        self.tokenizer = tokenizer
        self.link = link  # every replica, behind one admission queue
        self._limits: Limits | None = None

    def _ready_limits(self, context) -> Limits:
        info = self.link.model_info
        if not self.link.ready or info is None:
            raise SchedulerUnavailable("the server is starting or its shards are unavailable")
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
            )
        return self._limits

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    async def _abort(self, context, span, code: grpc.StatusCode, message: str):
        """Ends the call with a status; counted and put on the request's span first."""
        self.metrics.failed.labels(code=code.name).inc()
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
        await context.abort(code, message)

    async def Generate(self, request, context):
        start = time.perf_counter()
        parent = tracing.context_from_metadata(context.invocation_metadata())
        span = self._tracer.start_span("tpserve.Generate", context=parent, kind=SpanKind.SERVER)
        try:
            async for resp in self._generate(request, context, span, start):
                yield resp
        finally:
            span.end()

    async def _generate(self, request, context, span, start: float):
        try:
            req = validate_request(request, self._ready_limits(context), self._tokenize)
        except ValidationError as e:
            await self._abort(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SchedulerUnavailable as e:
            await self._abort(context, span, grpc.StatusCode.UNAVAILABLE, str(e))
        request_id = req.request_id or uuid.uuid4().hex
        span.set_attributes(
            {"tpserve.request_id": request_id, "tpserve.prompt_tokens": len(req.prompt_token_ids)}
        )
        if self.link.in_flight(request_id):
            await self._abort(
                context,
                span,
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id!r} is already in flight",
            )
        add = scheduler_pb2.AddRequest(
            request_id=request_id,
            prompt_token_ids=req.prompt_token_ids,
            max_new_tokens=req.max_new_tokens,
            sampling=request.sampling,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            top_logprobs=req.top_logprobs,
            trace_context=tracing.carrier(span),
        )
        try:
            queue = self.link.submit(add)
        except SchedulerUnavailable as e:
            await self._abort(context, span, grpc.StatusCode.UNAVAILABLE, str(e))
        except QueueFull as e:
            await self._abort(context, span, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

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
                    code = STATUS_BY_CODE.get(out.error_code, grpc.StatusCode.INTERNAL)
                    await self._abort(context, span, code, out.error)
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
                        self.link.abort(request_id)
                    else:
                        self.link.done(request_id)
                    self._record_finish(
                        span, request_id, req, reason, num_generated, start, first_token_at, now
                    )
                yield resp
        finally:
            if not finished:
                # Cancelled, disconnected or past its deadline: free its KV blocks now.
                self.link.abort(request_id)
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

    async def GetModelInfo(self, request, context):
        if self.link.model_info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler has not reported yet")
        return self.link.model_info

    async def GetStats(self, request, context):
        try:
            stats = await self.link.stats()
        except SchedulerUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"GetStats: {e}")
        admission = self.link.admission
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


async def serve(config: RouterConfig) -> None:
    from transformers import AutoTokenizer

    provider = tracing.setup(config.tracing, "router")
    admission = AdmissionQueue(config.admission)
    policy = config.routing_policy
    router_metrics = RouterMetrics(admission)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    interceptors = []
    if config.api_key_file:
        keys = ApiKeys(security.read_api_keys(config.api_key_file))
        refused = router_metrics.failed.labels(code=grpc.StatusCode.UNAUTHENTICATED.name)
        interceptors.append(ApiKeyInterceptor(keys, on_refused=refused.inc))
        log.info("API keys required: %d loaded from %s", len(keys), config.api_key_file)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    def on_ready(ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", "tpserve.v1.Generation"):
            asyncio.ensure_future(health_servicer.set(service, status))

    on_ready(False)
    link = SchedulerPool(
        admission,
        policy,
        on_ready,
        schedulers=config.schedulers,
        dns=config.scheduler_dns,
        dns_interval_s=config.dns_interval_s,
        prefix_blocks=config.prefix_affinity_blocks,
        retry_s=config.scheduler_retry_s,
        tls=config.internal_tls,
    )
    router_metrics.watch_replicas(link)
    link.on_admit = lambda add, waited_s: router_metrics.queue_time.observe(waited_s)
    link.on_failover = router_metrics.count_failover
    servicer = GenerationServicer(config, tokenizer, link, router_metrics)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = security.add_port(server, f"{config.host}:{config.port}", config.tls)
    await server.start()
    await link.start()
    metrics_port = metrics.serve(router_metrics.registry, config.host, config.metrics_port)
    write_port_file(config.port_file, port, metrics_port)
    mode = "plaintext" if config.tls is None else "TLS" if config.tls.ca is None else "mutual TLS"
    log.info("router serving tpserve.v1.Generation on %s:%d (%s)", config.host, port, mode)
    if metrics_port is not None:
        log.info("router metrics on http://%s:%d/metrics", config.host, metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: probes see NOT_SERVING, new calls are refused (UNAVAILABLE), calls in flight may finish.
    log.info("draining: up to %.0fs for requests in flight", config.drain_timeout_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=config.drain_timeout_s)
    await link.close()
    if provider is not None:
        provider.shutdown()
