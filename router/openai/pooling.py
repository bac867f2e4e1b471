"""The pooling model's HTTP routes, each a parse into tpserve.v1's EmbedRequest or ScoreRequest, the
router's Embedder (router/embedding.py), and a render:

    POST /v1/embeddings  OpenAI's: {"model", "input": str | [str] | [int] | [[int]], "encoding_format":
                         "float" | "base64", "dimensions", "truncate_prompt_tokens" (vLLM's), "user"}
                         -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
                             "model", "usage": {"prompt_tokens", "total_tokens"}}
    POST /v1/score       vLLM's: {"model", "text_1": str, "text_2": str | [str]} (or text_1 a list as long
                         as text_2: pair by pair) -> {"object": "list", "data": [{"object": "score",
                         "index", "score"}], "usage"}
    POST /v1/rerank      Jina's and Cohere's: {"model", "query", "documents": [str | {"text"}], "top_n",
    POST /rerank         "return_documents"} -> {"results": [{"index", "relevance_score", "document"}]},
    POST /v2/rerank      best first (v2: Cohere's v2 body, documents as strings; the same answer)
    POST /pooling        vLLM's: {"model", "input" as /v1/embeddings', "encoding_format",
                         "truncate_prompt_tokens"} -> {"data": [{"object": "pooling", "index", "data"}]}:
                         each input's model output (an embedding, or a classifier's outputs)
    POST /classify       vLLM's, for a *ForSequenceClassification model: {"model", "input": str | [str],
                         "truncate_prompt_tokens"} -> {"data": [{"index", "label", "probs",
                         "num_classes"}]}: softmax over the labels (sigmoid for one), config.json's
                         id2label naming the most likely

Errors are OpenAI's shape (router/openai/errors.py), the field named as the client named it.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid

from aiohttp import web

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pooling import labels
from router.embedding import Embedder
from router.frontend import RequestFailed
from router.openai import fields as f
from router.openai.errors import bad_request, from_failure

EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "truncate_prompt_tokens", "user"}
SCORE_FIELDS = {"model", "text_1", "text_2", "truncate_prompt_tokens", "user"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "truncate_prompt_tokens", "user"}
POOLING_FIELDS = {"model", "input", "encoding_format", "truncate_prompt_tokens", "user"}
CLASSIFY_FIELDS = {"model", "input", "truncate_prompt_tokens", "user"}


def _object(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {f.kind(body)}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(unknown[0], f"unknown field {unknown[0]!r}; accepted: {sorted(allowed)}")
    return body


def _optional_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(name, f"{name} must be a positive integer, got {value!r}")
    return value


def _strings(value: object, name: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(s, str) for s in items):
        raise bad_request(name, f"{name} must be a string or a non-empty list of strings")
    return items


def embed_inputs(value: object) -> list[pb.EmbedInput]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [pb.EmbedInput(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            return [pb.EmbedInput(token_ids=pb.TokenIds(ids=value))]
        if all(isinstance(s, str) for s in value):
            return [pb.EmbedInput(text=s) for s in value]
        if all(
            isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids) for ids in value
        ):
            return [pb.EmbedInput(token_ids=pb.TokenIds(ids=ids)) for ids in value]
    raise bad_request(
        "input", "input must be a string, a list of strings, a list of token ids or a list of such lists"
    )


def _vector(values, encoding: str):
    if encoding == "float":
        return list(values)
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()  # OpenAI's: float32 LE


class PoolingRoutes:
    """The routes above, served by an OpenAIServer (its body, check_model and middlewares)."""

    def __init__(self, server):
        self.server = server
        self.embedder = Embedder(server.frontend)

    def routes(self) -> list:
        return [
            web.post("/v1/embeddings", self.embeddings),
            web.post("/v1/score", self.score),
            web.post("/v1/rerank", self.rerank),
            web.post("/rerank", self.rerank),
            web.post("/v2/rerank", self.rerank),
            web.post("/pooling", self.pooling),
            web.post("/classify", self.classify),
        ]

    async def _call(self, fn, request, params: dict[str, str]):
        try:
            return await fn(request)
        except RequestFailed as e:
            raise from_failure(e, params) from None

    async def embeddings(self, request: web.Request) -> web.Response:
        body = _object(await self.server.body(request), EMBEDDING_FIELDS)
        info = self.server.check_model(body.get("model"))
        encoding = _encoding(body)
        req = pb.EmbedRequest(request_id=f"embd-{uuid.uuid4().hex}", inputs=embed_inputs(body.get("input")))
        for name in ("dimensions", "truncate_prompt_tokens"):
            if (value := _optional_int(body, name)) is not None:
                setattr(req, name, value)
        resp = await self._call(self.embedder.embed, req, {"inputs": "input"})
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(e.values, encoding)}
            for i, e in enumerate(resp.embeddings)
        ]
        usage = {"prompt_tokens": resp.usage.prompt_tokens, "total_tokens": resp.usage.prompt_tokens}
        return web.json_response({"object": "list", "data": data, "model": info.model_name, "usage": usage})

    async def pooling(self, request: web.Request) -> web.Response:
        body = _object(await self.server.body(request), POOLING_FIELDS)
        info = self.server.check_model(body.get("model"))
        encoding = _encoding(body)
        resp = await self._outputs(body, embed_inputs(body.get("input")))
        data = [
            {"object": "pooling", "index": i, "data": _vector(e.values, encoding)}
            for i, e in enumerate(resp.embeddings)
        ]
        return web.json_response(_listing(f"pool-{uuid.uuid4().hex}", info, data, resp.usage.prompt_tokens))

    async def classify(self, request: web.Request) -> web.Response:
        body = _object(await self.server.body(request), CLASSIFY_FIELDS)
        info = self.server.check_model(body.get("model"))
        if info.runner == "pooling" and not info.cross_encoder:
            raise bad_request(None, f"{info.model_name} is an embedding model: /classify needs a classifier")
        texts = _strings(body.get("input"), "input")
        resp = await self._outputs(body, [pb.EmbedInput(text=t) for t in texts])
        names = labels(self.server.frontend.config.model)
        data = []
        for i, e in enumerate(resp.embeddings):
            probs = _probabilities(list(e.values))
            best = max(range(len(probs)), key=probs.__getitem__)
            label = names[best] if len(names) == len(probs) else f"LABEL_{best}"
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        return web.json_response(
            _listing(f"classify-{uuid.uuid4().hex}", info, data, resp.usage.prompt_tokens)
        )

    async def _outputs(self, body: dict, inputs: list[pb.EmbedInput]) -> pb.EmbedResponse:
        """Each input's model output (Embedder.embed, any pooling model)."""
        req = pb.EmbedRequest(request_id=f"pool-{uuid.uuid4().hex}", inputs=inputs)
        if (value := _optional_int(body, "truncate_prompt_tokens")) is not None:
            req.truncate_prompt_tokens = value
        return await self._call(lambda r: self.embedder.embed(r, classifier=True), req, {"inputs": "input"})

    async def score(self, request: web.Request) -> web.Response:
        body = _object(await self.server.body(request), SCORE_FIELDS)
        info = self.server.check_model(body.get("model"))
        firsts, seconds = _strings(body.get("text_1"), "text_1"), _strings(body.get("text_2"), "text_2")
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise bad_request(
                "text_1", f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: one, or as many"
            )
        truncate = _optional_int(body, "truncate_prompt_tokens")
        rid = uuid.uuid4().hex
        params = {"query": "text_1", "documents": "text_2"}
        if len(firsts) == 1:
            resps = [await self._call(self.embedder.score, _score(rid, firsts[0], seconds, truncate), params)]
        else:  # pair by pair, at once
            calls = [
                self._call(self.embedder.score, _score(f"{rid}-{i}", a, [b], truncate), params)
                for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
            ]
            resps = await asyncio.gather(*calls)
        scores = [s for r in resps for s in r.scores]
        tokens = sum(r.usage.prompt_tokens for r in resps)
        return web.json_response(
            {
                "id": f"score-{rid}",
                "object": "list",
                "created": int(time.time()),
                "model": info.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def rerank(self, request: web.Request) -> web.Response:
        body = _object(await self.server.body(request), RERANK_FIELDS)
        info = self.server.check_model(body.get("model"))
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise bad_request("query", "query must be a non-empty string")
        docs = body.get("documents")
        if not isinstance(docs, list) or not docs:
            raise bad_request("documents", "documents must be a non-empty list")
        texts = []
        for i, doc in enumerate(docs):
            text = doc.get("text") if isinstance(doc, dict) else doc
            if not isinstance(text, str):
                raise bad_request(
                    f"documents[{i}]", f"documents[{i}] must be a string or an object with text"
                )
            texts.append(text)
        top_n = _optional_int(body, "top_n") or len(texts)
        rid = uuid.uuid4().hex
        req = _score(rid, query, texts, _optional_int(body, "truncate_prompt_tokens"))
        resp = await self._call(self.embedder.score, req, {})
        order = sorted(range(len(texts)), key=lambda i: -resp.scores[i])[:top_n]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": resp.scores[i]}
            if body.get("return_documents", True):
                result["document"] = {"text": texts[i]}
            results.append(result)
        usage = {"prompt_tokens": resp.usage.prompt_tokens, "total_tokens": resp.usage.prompt_tokens}
        return web.json_response(
            {"id": f"rerank-{rid}", "model": info.model_name, "usage": usage, "results": results}
        )


def _encoding(body: dict) -> str:
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("encoding_format", f"encoding_format must be float or base64, got {encoding!r}")
    return encoding


def _listing(rid: str, info: pb.ModelInfo, data: list[dict], tokens: int) -> dict:
    """vLLM's /pooling and /classify answer."""
    return {
        "id": rid,
        "object": "list",
        "created": int(time.time()),
        "model": info.model_name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


def _probabilities(outputs: list[float]) -> list[float]:
    """A classifier's outputs as probabilities: one label's is already its sigmoid (the worker applies
    it, as sentence-transformers does); several labels' logits through softmax."""
    if len(outputs) == 1:
        return outputs
    top = max(outputs)
    exps = [math.exp(x - top) for x in outputs]
    return [x / sum(exps) for x in exps]


def _score(rid: str, query: str, documents: list[str], truncate: int | None) -> pb.ScoreRequest:
    req = pb.ScoreRequest(request_id=rid, query=query, documents=documents)
    if truncate is not None:
        req.truncate_prompt_tokens = truncate
    return req
