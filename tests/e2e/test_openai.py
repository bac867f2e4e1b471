"""The OpenAI-compatible HTTP API through the real processes, called with the official `openai` client:
what it returns equals what the gRPC API returns for the same request (both are one Frontend), and its
errors are the statuses and bodies that client understands."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from common.client import GenerationClient
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import ROOT, launch
from tests.e2e.test_reliability import wait_until
from tests.pki import API_KEY

SMOLLM2 = ROOT / "models" / "smollm2"
FINISH = {"LENGTH": "length", "EOS": "stop", "STOP": "stop"}

needs_smollm2 = pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(),
    reason="models/smollm2 is not built (`make model-smollm2` builds it; `make test` does it first)",
)


def client(info, key: str = "unused", **kw) -> openai.OpenAI:
    # max_retries=0: the client retries 429 and 5xx by itself, which would hide what the server said.
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{info['http_port']}/v1", api_key=key, max_retries=0, timeout=120, **kw
    )


def http_get(info, path: str) -> tuple[int, dict]:
    """A bare GET (no client library, no key): (status, JSON body)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{info['http_port']}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def tiny(tiny_model):
    # 127.0.0.1 allowed: the image tests' local host; tiny takes no images, so nothing is ever fetched.
    with launch(tiny_model, "--http-port", "0", "--allowed-media-domains", "127.0.0.1") as (target, info):
        yield target, info


@pytest.fixture(scope="module")
def smollm2(smollm2_stack):
    return smollm2_stack


# ---- the same answers as gRPC ----


def test_greedy_completion_equals_grpc_whole_and_streamed(tiny):
    target, info = tiny
    prompt = dict(max_tokens=24, temperature=0, seed=3)
    with GenerationClient(target, timeout=120) as grpc_client:
        want = grpc_client.complete(text="Once upon a time", max_new_tokens=24, temperature=0, seed=3)
        want_ids = grpc_client.complete(token_ids=[5, 17, 99], max_new_tokens=24, temperature=0, seed=3)
    c = client(info)
    got = c.completions.create(model="tiny", prompt="Once upon a time", **prompt)
    assert got.object == "text_completion" and got.id.startswith("cmpl-") and got.model == "tiny"
    (choice,) = got.choices
    assert choice.text == want.text and choice.finish_reason == FINISH[want.finish_reason_name]
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage.prompt_tokens,
        len(want.token_ids),
    )
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens

    chunks = list(
        c.completions.create(
            model="tiny",
            prompt="Once upon a time",
            stream=True,
            stream_options={"include_usage": True},
            **prompt,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == got.usage  # the usage chunk comes last

    by_ids = c.completions.create(model="tiny", prompt=[5, 17, 99], **prompt)
    assert by_ids.choices[0].text == want_ids.text and by_ids.usage.prompt_tokens == 3


def test_completion_logprobs_equal_grpcs(tiny):
    target, info = tiny
    with GenerationClient(target, timeout=120) as grpc_client:
        want = grpc_client.complete(text="The", max_new_tokens=6, temperature=0, top_logprobs=2)
    got = client(info).completions.create(model="tiny", prompt="The", max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.tokens == [x.chosen.text for x in want.logprobs] and len(lp.tokens) == len(want.token_ids)
    assert lp.token_logprobs == pytest.approx([x.chosen.logprob for x in want.logprobs])
    for top, x in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert top == pytest.approx({t.text: t.logprob for t in x.top[:2]})


@needs_smollm2
def test_greedy_chat_equals_grpc_whole_and_streamed(smollm2):
    target, info = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with GenerationClient(target, timeout=120) as grpc_client:
        want = grpc_client.complete(messages=messages, max_new_tokens=32, temperature=0, seed=0)
    c = client(info)
    got = c.chat.completions.create(
        model="smollm2", messages=messages, max_completion_tokens=32, temperature=0, seed=0
    )
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert "Paris" in want.text and "<|im_end|>" not in want.text
    assert choice.finish_reason == FINISH[want.finish_reason_name] == "stop"  # it ended at <|im_end|>
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage.prompt_tokens,
        len(want.token_ids),
    )

    chunks = list(
        c.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_completion_tokens=32,
            temperature=0,
            seed=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage == got.usage


# ---- errors ----


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(n=17), "n"),
        (dict(max_tokens=5000), "max_tokens"),  # tiny's max_model_len is 1024
        (dict(top_p=0), "top_p"),
        (dict(logprobs=50), "logprobs"),
    ],
)
def test_bad_requests_are_400_with_openais_error_body(tiny, kw, param):
    _, info = tiny
    with pytest.raises(openai.BadRequestError) as e:
        client(info).completions.create(model="tiny", prompt="hi", **kw)
    assert e.value.status_code == 400
    body = e.value.body  # the client hands over the "error" object
    assert set(body) == {"message", "type", "param", "code"}
    assert (body["type"], body["param"], body["code"]) == ("invalid_request_error", param, "INVALID_ARGUMENT")
    assert param in body["message"]


def test_bad_streamed_request_is_400_too(tiny):
    _, info = tiny
    with pytest.raises(openai.BadRequestError) as e:
        client(info).completions.create(model="tiny", prompt="hi", temperature=-1, stream=True)
    assert e.value.body["param"] == "temperature"


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server that records every path it is asked for (it should be asked for none)."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_error(404)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], hits
    server.shutdown()


@pytest.mark.parametrize(
    "url, words",
    [
        ("http://localhost:{port}/a.png", "'localhost' is not allowed"),  # only 127.0.0.1 is named
        ("file:///etc/passwd", "local files are not served"),
        ("data:text/plain;base64,aGk=", "not a supported image type"),
        ("http://127.0.0.1:{port}/a.png", "the served model does not take images"),  # refused before fetching
        ("data:image/png;base64,iVBORw0KGgo=", "the served model does not take images"),
    ],
)
def test_images_are_refused_with_400_and_nothing_fetched(tiny, image_host, url, words):
    _, info = tiny
    port, hits = image_host
    content = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": url.format(port=port)}},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client(info).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
    assert e.value.body["param"] == "messages[0].content[1].image_url"
    assert words in e.value.body["message"]
    # /tokenize renders the same conversation: the same refusal.
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}]}).encode()
    post = urllib.request.Request(f"http://127.0.0.1:{info['http_port']}/tokenize", body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as tokenize:
        urllib.request.urlopen(post, timeout=30)
    assert tokenize.value.code == 400 and words in json.loads(tokenize.value.read())["error"]["message"]
    assert hits == []


def test_unknown_model_is_404_and_models_lists_the_served_one(tiny):
    _, info = tiny
    c = client(info)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model"
    assert [m.id for m in c.models.list()] == ["tiny"]


def test_health_is_200_while_serving(tiny):
    _, info = tiny
    assert http_get(info, "/health") == (200, {"status": "SERVING"})


# ---- a disconnected stream frees its blocks ----


def test_a_stream_whose_client_disconnects_frees_every_block(tiny):
    target, info = tiny
    c = client(info)
    streams, max_tokens = 4, 1000  # far more than can be generated before the disconnect is seen
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        before = stub.GetStats(pb.StatsRequest())
        opened = [
            c.completions.create(
                model="tiny",
                prompt=f"long {i}",
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i in range(streams)
        ]
        for s in opened:
            next(iter(s))  # running: each holds KV blocks
        s = stub.GetStats(pb.StatsRequest())
        assert s.kv_blocks_free < s.kv_blocks_total and s.num_running == streams
        for s in opened:
            s.close()  # drops the connection mid-stream

        def freed():
            s = stub.GetStats(pb.StatsRequest())
            return s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 and s.num_waiting == 0

        wait_until(freed, 30, "every block free after the clients disconnected")
        after = stub.GetStats(pb.StatsRequest())
        # Aborted, not run to the end: the steps computed far fewer tokens than the streams asked for.
        assert after.batched_tokens_total - before.batched_tokens_total < streams * max_tokens


# ---- keys and a full queue ----


@pytest.fixture(scope="module")
def guarded(tiny_model, pki):
    """API keys on, and room for three requests: one running, one waiting in the scheduler, one queued."""
    flags = ("--http-port", "0", "--api-key-file", pki["api_keys"], "--max-queued-requests", "1")
    with launch(tiny_model, *flags, "--max-num-seqs", "1", "--admission-window", "1") as (target, info):
        yield target, info


def test_a_wrong_or_missing_key_is_401(guarded):
    _, info = guarded
    with pytest.raises(openai.AuthenticationError) as e:
        client(info, key="not-the-key").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    status, body = http_get(info, "/v1/models")  # no Authorization header at all
    assert status == 401 and body["error"]["code"] == "UNAUTHENTICATED"
    ok = client(info, key=API_KEY).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2
    assert http_get(info, "/health")[0] == 200  # probes need no key, as gRPC health


def test_a_full_queue_is_429_and_the_admitted_requests_complete(guarded):
    _, info = guarded

    def one(i):
        """Completion tokens, or the refusal's code; every other request streams (429 before its stream)."""
        c = client(info, key=API_KEY)
        kw = dict(model="tiny", prompt=f"q {i}", max_tokens=300, extra_body={"ignore_eos": True})
        try:
            if i % 2:
                chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
                return chunks[-1].usage.completion_tokens
            return c.completions.create(**kw).usage.completion_tokens
        except openai.RateLimitError as e:
            return e.body["code"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert "RESOURCE_EXHAUSTED" in results and 300 in results, results
    assert set(results) == {"RESOURCE_EXHAUSTED", 300}, results  # refused, or all 300 tokens
