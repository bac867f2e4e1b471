"""One choice's way back to the client: the outputs its replica sends, turned into GenerateResponses
(the tokens as text, split into reasoning and content by a reasoning parser, logprobs with their texts),
its finish with its own usage, and the metrics, span attributes and log line of a finished request.
Frontend (router/frontend.py) inherits it; what it reads of Frontend: tokenizer, metrics and pool."""

from __future__ import annotations

import logging
import time

import grpc

from common.pb.tpserve.v1 import generation_pb2
from router.request_failed import STATUS_BY_CODE, RequestFailed
from router.slo import record_slo

log = logging.getLogger("tpserve.router")

FINISH_STOP = generation_pb2.FINISH_REASON_STOP


class ChoiceStreams:
    async def _choice(self, req, request_id, index, rid, queue, texts, span, start, slo):
        """One choice's responses: its tokens as text (split into reasoning and content by a reasoning
        parser), then its finish (with its own usage)."""
        text_stream, thinking = texts
        decoding = self.tokenizer.decoding
        num_generated = 0
        first_token_at = last_token_at = None
        finished = False
        prompt_logprobs = []  # they come with the prompt's steps, before the first token
        if index == 0 and req.prompt_logprobs is not None:
            # The prompt's first token, which nothing predicts: its id and text, no logprob.
            first = generation_pb2.Logprobs(
                chosen=generation_pb2.TokenLogprob(token_id=req.prompt_token_ids[0])
            )
            await decoding.run(text_stream.fill_logprob_texts, [first])
            prompt_logprobs.append(first)
        try:
            while not finished:
                out = await queue.get()
                if out.error:
                    finished = True
                    raise RequestFailed(
                        STATUS_BY_CODE.get(out.error_code, grpc.StatusCode.INTERNAL), out.error
                    )
                if out.prompt_logprobs:
                    await decoding.run(text_stream.fill_logprob_texts, out.prompt_logprobs)
                    prompt_logprobs.extend(out.prompt_logprobs)
                if not out.token_ids and not out.finish_reason:
                    continue
                now = time.perf_counter()
                if first_token_at is None:
                    first_token_at = now
                    self.metrics.ttft.observe(now - start)
                else:
                    self.metrics.itl.observe(now - last_token_at)
                last_token_at = now
                num_generated += len(out.token_ids)
                # Decoding (the text, and each logprob's alternatives) runs off the event loop, batched
                # with the other requests' tokens of the same step.
                text, stopped = await decoding.run(
                    text_stream.step, out.token_ids, out.finish_reason, out.logprobs
                )
                reason = FINISH_STOP if stopped else out.finish_reason
                reasoning, text = thinking.step(text, out.token_ids, bool(reason)) if thinking else ("", text)
                resp = generation_pb2.GenerateResponse(
                    request_id=request_id,
                    token_ids=out.token_ids,
                    text=text,
                    reasoning_text=reasoning,
                    finish_reason=reason,
                    index=index,
                    stop_string=text_stream.matched_stop if stopped else "",
                )
                resp.logprobs.extend(out.logprobs)
                resp.prompt_logprobs.extend(prompt_logprobs)
                prompt_logprobs = []
                if reason:
                    finished = True
                    resp.usage.CopyFrom(
                        generation_pb2.Usage(
                            prompt_tokens=len(req.prompt_token_ids),
                            completion_tokens=num_generated,
                            cached_tokens=out.cached_tokens,
                            reasoning_tokens=thinking.reasoning_tokens if thinking else 0,
                        )
                    )
                    if stopped:
                        self.pool.abort(rid)
                    else:
                        self.pool.done(rid)
                    self._record_finish(span, rid, req, reason, num_generated, start, first_token_at, now)
                    record_slo(self.metrics, slo, first_token_at - start, num_generated, now - first_token_at)
                yield resp
        finally:
            if not finished:
                # Cancelled, disconnected or past its deadline: free its KV blocks now.
                self.pool.abort(rid)
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
