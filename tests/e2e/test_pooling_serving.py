"""Pooling through the real processes (`tpserve launch`): the default embedding model, all-MiniLM-L6-v2
(`make model PRESET=minilm`; mean pooling, Normalize, max_seq_length 256), served at TP 2, and a random
BERT cross-encoder at TP 1, called through the openai client, bare HTTP and gRPC, against transformers
pooled as sentence-transformers pools it (tests/pooling_models.py), on this module's own sentences. Bad
inputs are refused with the field and the limit; a generation call to a pooling model and the reverse are
refused in one line; embeddings and generation on two stacks at once give what each gives alone. Two
stacks of this module's own (the generation one is the session's SmolLM2, shared with other modules).
vLLM's /classify and /pooling and Cohere's /v2/rerank on the same two."""

from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import ROOT, launch
from tests.conftest import post_json as post
from tests.e2e.test_reliability import wait_until
from tests.pooling_models import build, reference

MINILM = ROOT / "models" / "minilm"
SENTENCES = [
    "the cat sat on the mat",
    "paris is the capital of france",
    "what is the capital city",
    "a big red car on a small road by the river where the slow green tree was",
    "sun",
]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat", "a river in the city", "the capital city is big"]


def client(info) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{info['http_port']}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def embedder():
    if not (MINILM / "config.json").is_file():
        pytest.skip("models/minilm is not built (`make model PRESET=minilm`; `make test` does it first)")
    with launch(MINILM, "--http-port", "0", "--tp", "2", "--max-num-batched-tokens", "256") as (target, info):
        yield MINILM, target, info


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    model = build("bert-cross", tmp_path_factory.mktemp("cross") / "bert-cross")
    with launch(model, "--http-port", "0") as (target, info):
        yield model, target, info


def token_ids(model, texts: list[str], pair: str | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok(t, pair) if pair is None else tok(pair, t) for t in texts]


def assert_ranked(results: list[dict], want: list[float], top_n: int | None = None) -> None:
    """A rerank answer ranks the reference scores: each result's score is its document's (1e-5), they
    come best first, and the top_n are the best top_n. Order is judged on the reference's scores, so
    two documents the random model scores within 1e-5 of each other may come either way round."""
    top_n = len(want) if top_n is None else top_n
    got = [r["relevance_score"] for r in results]
    assert len(results) == top_n and len({r["index"] for r in results}) == top_n
    assert got == pytest.approx([want[r["index"]] for r in results], abs=1e-5)
    assert all(a >= b - 1e-5 for a, b in zip(got, got[1:], strict=False))
    left_out = [w for i, w in enumerate(want) if i not in {r["index"] for r in results}]
    assert all(min(got) >= w - 1e-5 for w in left_out)


def cosines(got, want) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), want, dim=-1).tolist()


def test_embeddings_equal_sentence_transformers_pooling_at_tp2(embedder, one_thread):
    model, _, info = embedder
    want = reference(model, [e["input_ids"] for e in token_ids(model, SENTENCES)])
    resp = client(info).embeddings.create(model="minilm", input=SENTENCES)  # the openai client: base64
    got = [d.embedding for d in resp.data]
    assert [d.index for d in resp.data] == list(range(len(SENTENCES)))
    assert min(cosines(got, want)) >= 0.99999
    assert resp.usage.prompt_tokens == sum(len(e["input_ids"]) for e in token_ids(model, SENTENCES))
    # float, one string, token ids, and Matryoshka's first 16 components at unit length again
    status, body = post(info, "/v1/embeddings", {"input": SENTENCES[1], "encoding_format": "float"})
    assert status == 200 and cosines([body["data"][0]["embedding"]], want[1:2])[0] >= 0.99999
    ids = token_ids(model, SENTENCES[:2])
    status, body = post(info, "/v1/embeddings", {"input": [e["input_ids"] for e in ids], "dimensions": 16})
    short = torch.nn.functional.normalize(want[:2, :16], dim=-1)
    assert status == 200 and min(cosines([d["embedding"] for d in body["data"]], short)) >= 0.99999
    assert [len(d["embedding"]) for d in body["data"]] == [16, 16]
    status, body = post(info, "/v1/embeddings", {"input": "sun", "encoding_format": "base64"})
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(got[4], abs=1e-6)


def test_grpc_embed_score_and_freed_blocks(embedder, one_thread):
    model, target, _ = embedder
    ids = [e["input_ids"] for e in token_ids(model, SENTENCES)]
    want = reference(model, ids)
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(pb.ModelInfoRequest())
        assert (info.runner, info.embedding_size, info.cross_encoder) == ("pooling", 384, False)
        inputs = [pb.EmbedInput(token_ids=pb.TokenIds(ids=i)) for i in ids]
        resp = stub.Embed(pb.EmbedRequest(request_id="e1", inputs=inputs))
        assert min(cosines([list(e.values) for e in resp.embeddings], want)) >= 0.99999
        assert [e.prompt_tokens for e in resp.embeddings] == [len(i) for i in ids]
        # An embedding model scores by cosine similarity.
        score = stub.Score(pb.ScoreRequest(query=SENTENCES[2], documents=SENTENCES[:2]))
        assert list(score.scores) == pytest.approx(cosines(want[:2], want[2:3].expand(2, -1)), abs=1e-5)
        stats = wait_until(
            lambda: (s := stub.GetStats(pb.StatsRequest())).kv_blocks_free == s.kv_blocks_total and s,
            30,
            "every block back",
        )
        assert stats.num_running == 0


def test_bad_inputs_are_refused_with_the_field_and_the_limit(embedder, cross_encoder):
    model, target, info = embedder
    long_text = " ".join(["cat"] * 300)  # 302 tokens: over max_seq_length 256
    status, body = post(info, "/v1/embeddings", {"input": ["sun", long_text]})
    assert status == 400 and body["error"]["param"] == "input[1]"
    assert "302 tokens; the limit is 256" in body["error"]["message"]
    # ... or cut to fit when asked: the vector of the first 20 tokens.
    status, body = post(info, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 20})
    cut = token_ids(model, [" ".join(["cat"] * 18)])[0]["input_ids"]
    assert status == 200 and body["usage"]["prompt_tokens"] == 20
    assert cosines([body["data"][0]["embedding"]], reference(model, [cut]))[0] >= 0.99999
    for bad, param in (
        ({"input": []}, "input"),
        ({"input": "sun", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "sun", "dimensions": 385}, "dimensions"),
        ({"input": [[101, 2, 99999]]}, None),
        ({"input": "sun", "bogus": 1}, "bogus"),
    ):
        status, body = post(info, "/v1/embeddings", bad)
        assert status == 400, bad
        assert body["error"]["param"] == param, (bad, body)
    status, body = post(info, "/v1/completions", {"prompt": "the cat", "max_tokens": 2})
    assert status == 400 and "served for pooling" in body["error"]["message"]
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="the cat", max_new_tokens=2)))
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "served for pooling" in e.value.details()
        )
    # A cross-encoder scores pairs: it does not embed.
    status, body = post(cross_encoder[2], "/v1/embeddings", {"input": "sun"})
    assert status == 400 and "cross-encoder" in body["error"]["message"]


def test_rerank_and_score_equal_the_cross_encoder_in_transformers(cross_encoder, one_thread):
    model, _, info = cross_encoder
    pairs = token_ids(model, DOCS, pair=QUERY)
    want = reference(model, [p["input_ids"] for p in pairs], [p["token_type_ids"] for p in pairs])[
        :, 0
    ].tolist()
    # Jina's body (strings), and Cohere's (objects) with top_n and no documents back.
    status, body = post(info, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert status == 200
    assert_ranked(body["results"], want)
    assert body["results"][0]["document"] == {"text": DOCS[body["results"][0]["index"]]}
    assert body["usage"]["total_tokens"] == sum(len(p["input_ids"]) for p in pairs)
    docs = [{"text": d} for d in DOCS]
    status, body = post(
        info, "/rerank", {"query": QUERY, "documents": docs, "top_n": 2, "return_documents": False}
    )
    assert status == 200
    assert_ranked(body["results"], want, top_n=2)
    assert "document" not in body["results"][0]
    status, body = post(info, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200 and [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    status, body = post(info, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS[:2]})  # pair by pair
    assert status == 200 and [d["score"] for d in body["data"]] == pytest.approx(want[:2], abs=1e-5)
    status, body = post(info, "/v1/rerank", {"query": "", "documents": DOCS})
    assert status == 400 and body["error"]["param"] == "query"


def test_classify_pooling_and_v2_rerank(embedder, cross_encoder, one_thread):
    """vLLM's /classify and /pooling (one text each: the classifier's output, id2label naming it) and
    Cohere's v2 rerank body, against transformers; /pooling on an embedding model is its embedding."""
    model, _, info = cross_encoder
    singles = token_ids(model, DOCS)
    want = reference(model, [e["input_ids"] for e in singles], [e["token_type_ids"] for e in singles])
    status, body = post(info, "/classify", {"input": DOCS})
    assert status == 200 and [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert [d["probs"][0] for d in body["data"]] == pytest.approx(want[:, 0].tolist(), abs=1e-5)
    assert {(d["label"], d["num_classes"]) for d in body["data"]} == {("relevant", 1)}
    assert body["usage"]["prompt_tokens"] == sum(len(e["input_ids"]) for e in singles)
    status, body = post(info, "/pooling", {"input": DOCS[0]})
    assert status == 200 and body["data"][0]["data"] == pytest.approx(want[0].tolist(), abs=1e-5)
    pairs = token_ids(model, DOCS, pair=QUERY)
    scores = reference(model, [p["input_ids"] for p in pairs], [p["token_type_ids"] for p in pairs])
    status, body = post(info, "/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3})
    assert status == 200
    assert_ranked(body["results"], scores[:, 0].tolist(), top_n=3)
    model, _, info = embedder
    want = reference(model, [e["input_ids"] for e in token_ids(model, SENTENCES[:2])])
    status, body = post(info, "/pooling", {"input": SENTENCES[:2], "encoding_format": "float"})
    assert status == 200 and min(cosines([d["data"] for d in body["data"]], want)) >= 0.99999
    assert {d["object"] for d in body["data"]} == {"pooling"}
    status, body = post(info, "/classify", {"input": "sun"})
    assert status == 400 and "embedding model" in body["error"]["message"]


def test_embeddings_beside_generation_on_two_stacks_disturb_neither(embedder, smollm2_stack, one_thread):
    model, _, info = embedder
    gen_target, _ = smollm2_stack
    want = reference(model, [e["input_ids"] for e in token_ids(model, SENTENCES)])
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):"]

    def generate(text: str) -> list[int]:
        with grpc.insecure_channel(gen_target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                text=text, max_new_tokens=12, sampling=pb.SamplingParams(temperature=0)
            )
            return [t for r in stub.Generate(request) for t in r.token_ids]

    def embed(k: int) -> list[list[float]]:
        batch = SENTENCES[k % len(SENTENCES) :] + SENTENCES[: k % len(SENTENCES)]
        status, body = post(info, "/v1/embeddings", {"input": batch, "encoding_format": "float"})
        assert status == 200, body
        return [d["embedding"] for d in body["data"]], k

    alone = [generate(p) for p in prompts]
    with ThreadPoolExecutor(12) as pool:
        embeddings = [pool.submit(embed, k) for k in range(9)]
        generations = [pool.submit(generate, p) for p in prompts]
        assert [g.result() for g in generations] == alone
        for future in embeddings:
            got, k = future.result()
            order = [(i + k) % len(SENTENCES) for i in range(len(SENTENCES))]
            assert min(cosines(got, want[order])) >= 0.99999
