"""Embed and Score, the pooling model's calls (tpserve.v1.Generation): each input tokenized, checked against
the model's limits, sent as one pooling request (scheduler.proto AddRequest.pooling) through the same
admission queue and replicas as generation, and its vector awaited. The gRPC servicer and the HTTP
routes (/v1/embeddings, /v1/score, /v1/rerank, /pooling, /classify: router/openai/pooling.py) call these two
and render them.
"""

from __future__ import annotations

import asyncio
import math
import uuid

import grpc

from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.v1 import generation_pb2 as pb
from router.frontend import Frontend
from router.request_failed import STATUS_BY_CODE, RequestFailed

MAX_INPUTS = 2048  # OpenAI's cap on one embeddings request's inputs


def _invalid(message: str, field: str | None = None) -> RequestFailed:
    return RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, message, field)


class Embedder:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    def _info(self, what: str) -> pb.ModelInfo:
        info = self.frontend.model_info()
        self.frontend._ready_limits()  # UNAVAILABLE while no replica serves
        if info.runner != "pooling":
            raise _invalid(f"{what} needs a pooling model; {info.model_name} is served for generation")
        return info

    async def embed(self, request: pb.EmbedRequest, classifier: bool = False) -> pb.EmbedResponse:
        """Each input's vector. classifier: the model's output for each input whatever the model
        (/pooling, /classify: a classifier's labels for one text, not a pair's score), not only an
        embedding model's."""
        info = self._info("Embed")
        if info.cross_encoder and not classifier:
            raise _invalid(f"{info.model_name} is a cross-encoder: it scores pairs (Score, /v1/rerank)")
        if request.HasField("dimensions") and info.cross_encoder:
            raise _invalid(f"{info.model_name} is a classifier: dimensions does not apply", "dimensions")
        _check_count(len(request.inputs), "inputs")
        if request.HasField("dimensions") and not 1 <= request.dimensions <= info.embedding_size:
            raise _invalid(
                f"dimensions {request.dimensions} must be in [1, {info.embedding_size}]", "dimensions"
            )
        truncate = _truncation(request)
        prompts = await self.tokenizer.run(self._encode_inputs, request.inputs, truncate)
        self._check_lengths(prompts, info, "inputs")
        vectors = await self._pool(request.request_id, [(ids, 0) for ids in prompts])
        response = pb.EmbedResponse(request_id=request.request_id)
        for ids, vector in zip(prompts, vectors, strict=True):
            if request.HasField("dimensions"):
                vector = _matryoshka(vector, request.dimensions)
            response.embeddings.add(values=vector, prompt_tokens=len(ids))
        response.usage.prompt_tokens = sum(len(ids) for ids in prompts)
        return response

    async def score(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        info = self._info("Score")
        _check_count(len(request.documents), "documents")
        truncate = _truncation(request)
        response = pb.ScoreResponse(request_id=request.request_id)
        if info.cross_encoder:
            if info.embedding_size != 1:
                raise _invalid(
                    f"{info.model_name} gives {info.embedding_size} labels per pair, not one score"
                )
            pairs = await self.tokenizer.run(self._encode_pairs, request.query, request.documents, truncate)
            self._check_lengths([ids for ids, _ in pairs], info, "documents")
            response.scores.extend(v[0] for v in await self._pool(request.request_id, pairs))
            response.usage.prompt_tokens = sum(len(ids) for ids, _ in pairs)
            return response
        texts = [request.query, *request.documents]
        inputs = [pb.EmbedInput(text=t) for t in texts]
        prompts = await self.tokenizer.run(self._encode_inputs, inputs, truncate)
        self._check_lengths(prompts, info, "documents")
        query, *docs = await self._pool(request.request_id, [(ids, 0) for ids in prompts])
        response.scores.extend(_cosine(query, d) for d in docs)
        response.usage.prompt_tokens = sum(len(ids) for ids in prompts)
        return response

    # ---- off the loop: the tokenizer's threads ----

    def _encode_inputs(self, inputs, truncate: int | None) -> list[list[int]]:
        """Token ids given as they are; the texts in one call to the tokenizer (the same ids; 64 of the
        bench's sentences in 5.8 ms against 6.8 ms text by text, on the router's core)."""
        prompts: list[list[int] | None] = []
        texts, at = [], []
        for i, item in enumerate(inputs):
            if item.WhichOneof("prompt") == "token_ids":
                ids = list(item.token_ids.ids)
                prompts.append(ids[:truncate] if truncate else ids)
                continue
            if not item.text:
                raise _invalid(f"inputs[{i}] is empty", f"inputs[{i}]")
            self._need_tokenizer(f"inputs[{i}]")
            prompts.append(None)
            texts.append(item.text)
            at.append(i)
        if texts:
            kwargs = {"truncation": True, "max_length": truncate} if truncate else {}
            for i, ids in zip(at, self.tokenizer.hf(texts, **kwargs)["input_ids"], strict=True):
                prompts[i] = list(ids)
        return prompts

    def _encode_pairs(self, query: str, documents, truncate: int | None) -> list[tuple[list[int], int]]:
        """Each (query, document) as the cross-encoder reads it, and where the document's token type 1
        starts (0 when the tokenizer gives no token types: XLM-R's)."""
        if not query:
            raise _invalid("query is empty", "query")
        self._need_tokenizer("query")
        kwargs = {"truncation": True, "max_length": truncate} if truncate else {}
        pairs = []
        for doc in documents:
            enc = self.tokenizer.hf(query, doc, **kwargs)
            types = enc.get("token_type_ids") or []
            pairs.append((list(enc["input_ids"]), types.index(1) if 1 in types else 0))
        return pairs

    def _need_tokenizer(self, field: str) -> None:
        if self.tokenizer.hf is None:
            raise _invalid("the model has no tokenizer: send inputs as token ids", field)

    # ---- on the loop ----

    def _check_lengths(self, prompts: list[list[int]], info: pb.ModelInfo, field: str) -> None:
        for i, ids in enumerate(prompts):
            if not ids:
                raise _invalid(f"{field}[{i}] has no tokens", f"{field}[{i}]")
            if len(ids) > info.max_model_len:
                raise _invalid(
                    f"{field}[{i}] has {len(ids)} tokens; the limit is {info.max_model_len} "
                    "(truncate_prompt_tokens cuts inputs to fit)",
                    f"{field}[{i}]",
                )
            bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise _invalid(f"{field}[{i}]: token id {bad} is not below vocab_size {info.vocab_size}")

    async def _pool(self, request_id: str, prompts: list[tuple[list[int], int]]) -> list[list[float]]:
        """Each prompt (token ids, token type start) as one pooling request; their vectors, in order."""
        base = request_id or uuid.uuid4().hex
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        if any(self.frontend.pool.in_flight(i) for i in ids):
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"request_id {base!r} is already in flight")
        queues, finished = [], set()
        try:
            for rid, (tokens, type_start) in zip(ids, prompts, strict=True):
                add = scheduler_pb2.AddRequest(
                    request_id=rid, prompt_token_ids=tokens, pooling=True, token_type_start=type_start
                )
                queues.append(self.frontend._submit(add))

            async def one(rid: str, queue: asyncio.Queue) -> list[float]:
                while True:
                    out = await queue.get()
                    if out.error:
                        finished.add(rid)
                        raise RequestFailed(
                            STATUS_BY_CODE.get(out.error_code, grpc.StatusCode.INTERNAL), out.error
                        )
                    if out.finish_reason:
                        finished.add(rid)
                        self.frontend.pool.done(rid)
                        if not out.embedding:
                            raise RequestFailed(grpc.StatusCode.INTERNAL, "the replica returned no vector")
                        return list(out.embedding)

            return await asyncio.gather(*(one(r, q) for r, q in zip(ids, queues, strict=False)))
        finally:
            for rid in ids:
                if rid not in finished:
                    self.frontend.pool.abort(rid)  # failed, cancelled or not sent: its blocks go back


def _truncation(request) -> int | None:
    if not request.HasField("truncate_prompt_tokens"):
        return None
    if request.truncate_prompt_tokens < 1:
        raise _invalid("truncate_prompt_tokens must be at least 1", "truncate_prompt_tokens")
    return request.truncate_prompt_tokens


def _check_count(n: int, field: str) -> None:
    if not 1 <= n <= MAX_INPUTS:
        raise _invalid(f"{field} has {n} entries; between 1 and {MAX_INPUTS} are served", field)


def _matryoshka(vector: list[float], dimensions: int) -> list[float]:
    """The first `dimensions` components, at unit length again when the model's vectors are (Matryoshka
    models are trained so that a prefix is an embedding)."""
    head = vector[:dimensions]
    full, part = math.sqrt(sum(x * x for x in vector)), math.sqrt(sum(x * x for x in head))
    if part and abs(full - 1.0) < 1e-3:
        head = [x / part for x in head]
    return head


def _cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(x * x for x in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0
