"""The path every public API shares: validate and tokenize a GenerateRequest, queue it for a replica, and
stream back its tokens as text (incremental detokenization, stop strings), with metrics and a span.

The gRPC servicer (router/grpc_api.py) and the OpenAI-compatible HTTP API (router/openai/server.py) only
decode their request into a GenerateRequest, iterate `Frontend.generate`, and encode what comes out; a
failure is a RequestFailed carrying the gRPC status (router/request_failed.py), which each API turns into
its own error shape in one place. A request whose caller goes away (the generator is closed) is aborted
and its KV freed. The way back, a choice's outputs turned into responses, is router/choice_stream.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from common import tracing
from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.v1 import generation_pb2
from common.sampling import SamplingConfig
from router.auth import ApiKeys, may_prioritize
from router.chat import chat_prompt, check_chat
from router.choice_stream import ChoiceStreams
from router.choices import choice_ids, choice_seed, merged
from router.config import RouterConfig
from router.lora import LoRANames
from router.media.loader import MediaLoader, takes_images
from router.media.render import ImagePromptRenderer, prompt_images
from router.metrics import RouterMetrics
from router.objectives import NotAllowed, for_request
from router.pool import SchedulerPool
from router.reasoning import for_request as reasoning_for
from router.request_failed import RequestFailed
from router.scheduler_link import QueueFull, SchedulerUnavailable
from router.slo import NO_OBJECTIVES, Objectives, SloRefused
from router.text_stream import TextStream
from router.tokenizer import NoChatTemplate, NoTokenizer, Tokenizer
from router.validation import (
    Limits,
    ValidatedRequest,
    ValidationError,
    add_special_tokens,
    prompt_field,
    validate_request,
)


class Frontend(ChoiceStreams):
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
        # The LoRA adapters served, loaded and unloaded while serving on every replica (router/lora.py).
        self.loras = LoRANames(config, pool, RequestFailed)
        self.media = MediaLoader(config.media, takes_images(config.model))  # a chat request's images
        # The checkpoint's own processor (placeholders expanded, pixels prepared), for prompts with images.
        self.renderer = ImagePromptRenderer.from_pretrained(config.model) if self.media.takes_images else None
        pool.on_link_connected = self.loras.reconnected
        self.priority_keys: ApiKeys | None = None  # --priority-api-key-file (objectives.py for_request)

    # ---- what the APIs call ----

    def model_info(self) -> generation_pb2.ModelInfo:
        info = self.pool.model_info
        if info is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the scheduler has not reported yet")
        if self.config.served_model_name:  # the first --served-model-name is the name every API reports
            named = generation_pb2.ModelInfo()
            named.CopyFrom(info)
            named.model_name = self.config.served_model_name[0]
            return named
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
        lora = request.lora_name if request.lora_name in self.loras else ""
        if lora:
            self.metrics.lora_requests.labels(lora_name=lora).inc()
            self.metrics.lora_in_flight.labels(lora_name=lora).inc()
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
            if lora:
                self.metrics.lora_in_flight.labels(lora_name=lora).dec()

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

    async def tokenize(
        self, request: generation_pb2.GenerateRequest, token_strs: bool = False
    ) -> tuple[list[int], list[str] | None, int]:
        """A text or chat prompt's token ids as generate renders it (vLLM's /tokenize), their vocabulary
        strings when asked, and max_model_len; no length rule (tokenizing is how a client learns it fits)."""
        limits = self._ready_limits()
        tok = self.tokenizer

        def encode() -> tuple[list[int], list[str] | None]:
            check_chat(request, limits.max_chat_messages, limits.prompt_char_limit)
            if images:  # the placeholders expanded, as generate renders them
                prompt = chat_prompt(request)
                ids = self.renderer.render(tok.chat_text(prompt), prompt, images).token_ids
            elif request.messages:
                ids = tok.render_chat(chat_prompt(request))
            elif len(request.text) > limits.prompt_char_limit:
                raise ValidationError(
                    "text", f"text is {len(request.text)} characters; the limit is {limits.prompt_char_limit}"
                )
            else:
                ids = tok.encode(request.text, add_special_tokens(request))
            return ids, tok.token_strs(ids) if token_strs else None

        images = await self._checked(self.media.load(request), request)  # as generate refuses them
        ids, strs = await self._checked(tok.run(encode), request)
        return ids, strs, limits.max_model_len

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included (vLLM's /detokenize)."""
        limits = self._ready_limits()
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise RequestFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tokens[{bad}] = {token_ids[bad]} is not in [0, vocab_size {limits.vocab_size})",
                f"tokens[{bad}]",
            )
        return await self.tokenizer.decoding.run(self.tokenizer.decode, token_ids)

    async def _validate(self, request: generation_pb2.GenerateRequest, images=()) -> ValidatedRequest:
        """images: the request's decoded images (MediaLoader.load); the prompt is then rendered by the
        checkpoint's processor, and the result's .images are AddRequest.images (pixels included)."""
        limits = self._ready_limits()
        tok = self.tokenizer
        if images:
            # The processor tokenizes the template's text with the images' placeholders expanded and
            # prepares each image's pixels (resize, rescale, normalise): on the tokenizer's threads, like
            # any prompt, never on the event loop.
            prepared = []

            def render_chat(prompt) -> list[int]:
                rendered = self.renderer.render(tok.chat_text(prompt), prompt, images)
                prepared[:] = prompt_images(rendered.images)  # the pixels packed here too, off the loop
                return rendered.token_ids

            validating = tok.run(validate_request, request, limits, tok.encode, render_chat, tok.encode_words)
            req = await self._checked(validating, request)
            return dataclasses.replace(req, images=tuple(prepared))
        light = not request.sampling.bad_words and not request.sampling.HasField("structured_output")
        if len(request.token_ids) and light:  # nothing to tokenize or compile: cheap enough for the loop
            return await self._checked(_done(validate_request, request, limits), request)
        # The fields are checked first (they bound what the tokenizer is asked to do; a grammar is compiled),
        # then the prompt (and any bad_words) is tokenized and checked: all of it on the tokenizer's threads.
        validating = tok.run(validate_request, request, limits, tok.encode, tok.render_chat, tok.encode_words)
        return await self._checked(validating, request)

    async def _checked(self, work, request: generation_pb2.GenerateRequest):
        """Awaits work, turning the checks' and the tokenizer's refusals into INVALID_ARGUMENT."""
        try:
            return await work
        except ValidationError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
        except NoChatTemplate as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), "messages") from None
        except NoTokenizer as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), prompt_field(request)) from None

    async def _generate(self, request, span, start: float):
        if request.lora_name and request.lora_name not in self.loras:
            raise RequestFailed(
                grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name!r} is not served", "lora_name"
            )
        images = await self._checked(self.media.load(request), request)  # refused, or read, first
        req = await self._validate(request, images)
        # Before the tool-call parser and the grammar: both see only the content after a think block.
        parser, tok = self.config.reasoning_parser, self.tokenizer
        req, thinking = await self._checked(_done(reasoning_for, parser, tok, request, req), request)
        request_id = req.request_id or uuid.uuid4().hex
        span.set_attributes(
            {"tpserve.request_id": request_id, "tpserve.prompt_tokens": len(req.prompt_token_ids)}
        )
        if request.lora_name:
            span.set_attribute("tpserve.lora_name", request.lora_name)
        ids = choice_ids(request_id, req.n)
        if any(self.pool.in_flight(i) for i in ids):
            raise RequestFailed(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight"
            )
        objectives, bucket = self._objectives(request, len(req.prompt_token_ids))
        submitted, queues = [], []
        try:
            for i, rid in enumerate(ids):  # a full queue at choice i aborts the choices before it
                add = self._add(req, i, rid, ids[0], span, request.lora_name)
                add.priority = objectives.priority
                add.tpot_objective_ms = round((objectives.tpot_s or 0) * 1000)
                add.images.extend(req.images)
                queues.append(self._submit(add, objectives))
                submitted.append(rid)
            # Built off the loop too: each decodes the prompt's tail.
            streams = [
                await self.tokenizer.decoding.run(
                    TextStream,
                    self.tokenizer,
                    req.prompt_token_ids,
                    stop=req.stop,
                    min_tokens=req.sampling.min_tokens,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    skip_special_tokens=req.skip_special_tokens,
                )
                for _ in ids
            ]
        except BaseException:
            for rid in submitted:
                self.pool.abort(rid)
            raise
        choices = [
            self._choice(
                req,
                request_id,
                i,
                rid,
                queues[i],
                (streams[i], thinking()),
                span,
                start,
                (objectives, bucket),
            )
            for i, rid in enumerate(ids)
        ]
        async for resp in merged(choices, prompt_logprobs=req.prompt_logprobs is not None):
            yield resp

    def _add(
        self, req: ValidatedRequest, index: int, rid: str, first: str, span, lora_name: str = ""
    ) -> scheduler_pb2.AddRequest:
        """Choice index's AddRequest: its own seed; the first choice's prompt to share; prompt logprobs
        computed by the first choice only (the others share its prompt, and get a copy)."""
        sampling = req.sampling
        if index and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=choice_seed(sampling.seed, index))
        return scheduler_pb2.AddRequest(
            request_id=rid,
            prompt_token_ids=req.prompt_token_ids,
            max_new_tokens=req.max_new_tokens,
            sampling=sampling.to_proto(),
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            top_logprobs=req.top_logprobs,
            trace_context=tracing.carrier(span),
            fork_of=first if index else "",
            want_prompt_logprobs=req.prompt_logprobs is not None and index == 0,
            prompt_logprobs=req.prompt_logprobs or 0,
            lora_name=lora_name,
        )

    def _objectives(
        self, request: generation_pb2.GenerateRequest, prompt_tokens: int
    ) -> tuple[Objectives, str]:
        edges, may = self.config.admission.bucket_edges, may_prioritize(self.priority_keys)
        try:
            return for_request(self.config.slo, edges, request, prompt_tokens, may)
        except NotAllowed as e:
            raise RequestFailed(grpc.StatusCode[e.status], str(e), e.field) from None

    def _submit(self, add: scheduler_pb2.AddRequest, objectives: Objectives = NO_OBJECTIVES):
        try:
            return self.pool.submit(add, objectives)
        except SloRefused as e:
            raise RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry_after_s=e.retry_after_s
            ) from None
        except NotAllowed as e:  # a TPOT objective no step meets: no retry helps (slo.py TpotInfeasible)
            raise RequestFailed(grpc.StatusCode[e.status], str(e), e.field) from None
        except SchedulerUnavailable as e:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except QueueFull as e:
            limit = self.config.admission.max_queued_requests
            raise RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e} (the limit: --max-queued-requests {limit})"
            ) from None


async def _done(fn, *args):
    """fn(*args) as an awaitable, run here: for work too small to hand to a thread."""
    return fn(*args)
