"""The OpenAI-compatible API without the real processes: JSON bodies -> GenerateRequest, GenerateResponses ->
OpenAI's objects, RequestFailed -> HTTP errors (router/openai/protocol.py, errors.py), and the aiohttp
server itself (router/openai/server.py) over a scripted stand-in for the Frontend: SSE framing, errors
before and after the stream starts, keys, health, and a client that disconnects closing the Frontend's
generator."""

from __future__ import annotations

import asyncio
import json
import ssl
from types import SimpleNamespace

import aiohttp
import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.security import TlsFiles
from router.auth import ApiKeys
from router.frontend import RequestFailed
from router.lora import LoRANames
from router.openai.encoder import Encoder
from router.openai.errors import ApiError, from_failure
from router.openai.protocol import parse_chat, parse_completion
from router.openai.server import OpenAIServer

# ---- requests ----


def test_completion_body_becomes_a_generate_request():
    body = {
        "model": "m",
        "prompt": "Once upon",
        "max_tokens": 20,
        "temperature": 0,
        "top_p": 0.9,
        "seed": 7,
        "stop": "\n",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "user": "accepted, no effect",
    }
    req = parse_completion(body, "r1")
    g = req.generate
    assert (g.request_id, g.text, g.max_new_tokens, list(g.stop)) == ("r1", "Once upon", 20, ["\n"])
    assert g.sampling.temperature == 0 and g.sampling.HasField("temperature")
    assert g.sampling.top_p == pytest.approx(0.9) and g.sampling.seed == 7
    assert g.sampling.presence_penalty == 0.5 and g.sampling.frequency_penalty == -0.5
    # Unset fields stay unset: the server's defaults apply, as on gRPC.
    assert not g.sampling.HasField("top_k") and not g.sampling.HasField("repetition_penalty")
    assert (req.model, req.stream, req.include_usage, req.logprobs, req.chat) == (
        "m",
        False,
        False,
        None,
        False,
    )


def test_completion_defaults_to_16_tokens_as_openai_and_chat_to_the_servers_default():
    assert parse_completion({"prompt": "x"}, "r").generate.max_new_tokens == 16
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]}, "r").generate
    assert not chat.HasField("max_new_tokens")


@pytest.mark.parametrize(
    "prompt, text, ids",
    [("hi", "hi", []), (["hi"], "hi", []), ([5, 6, 7], "", [5, 6, 7]), ([[5, 6]], "", [5, 6])],
)
def test_completion_prompt_forms(prompt, text, ids):
    g = parse_completion({"prompt": prompt}, "r").generate
    assert g.text == text and list(g.token_ids) == ids


def test_completion_logprobs_asks_for_at_least_one_alternative():
    # The proto's 0 means no logprobs; OpenAI's 0 means the chosen token's only.
    req = parse_completion({"prompt": "x", "logprobs": 0}, "r")
    assert req.generate.top_logprobs == 1 and req.logprobs == 0
    req = parse_completion({"prompt": "x", "logprobs": 3}, "r")
    assert req.generate.top_logprobs == 3 and req.logprobs == 3


def test_chat_body_becomes_messages():
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 5,
        "max_completion_tokens": 9,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["x", "y"],
        "top_k": -1,  # vLLM's "no cut"
    }
    req = parse_chat(body, "r")
    g = req.generate
    assert [(m.role, m.content) for m in g.messages] == [
        ("system", "Be brief."),
        ("user", "a\nb"),
        ("assistant", ""),
    ]
    assert g.max_new_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert (g.top_logprobs, req.logprobs, req.stream, req.include_usage) == (2, 2, True, True)
    assert list(g.stop) == ["x", "y"] and g.sampling.top_k == 0 and g.sampling.HasField("top_k")
    assert req.params["max_new_tokens"] == "max_completion_tokens"


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "x", "n": 17}, "n", "must be in [1, 16]"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of", "must be at least n"),
        ({"prompt": "x", "best_of": 3, "stream": True}, "best_of", "cannot be used with stream"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "set one of"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "must be"),
        (
            {"prompt": "x", "structured_outputs": {"structural_tag": "t"}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unrecognized request field"),
        ({"prompt": "x", "tools": []}, "tools", "of /v1/chat/completions only"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number, got a string"),
        ({"prompt": "x", "temperature": True}, "temperature", "must be a number, got a boolean"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens must be at least 1, got -1"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
        ({"prompt": "x", "seed": -3}, "seed", "must be in [0,"),
        ({"prompt": "x", "stop": [1]}, "stop", "a string or an array of strings"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"prompt": ["a", []]}, "prompt[1]", "is empty"),
        ({"prompt": []}, "prompt", "must be a string"),
        ({}, "prompt", "must be a string"),
        ({"prompt": "x", "model": 3}, "model", "must be a string"),
    ],
)
def test_completion_bodies_refused_before_the_frontend(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_completion(body, "r")
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"
    assert e.value.body()["error"]["code"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ],
)
def test_chat_bodies_refused_before_the_frontend(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body, "r")
    assert e.value.status == 400 and e.value.param == param


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(ApiError) as e:
        parse_completion(["prompt"], "r")
    assert e.value.status == 400 and "JSON object" in e.value.message


# ---- errors ----


@pytest.mark.parametrize(
    "code, status, kind",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
    ],
)
def test_status_codes_map_to_http(code, status, kind):
    e = from_failure(RequestFailed(code, "why"), {})
    assert e.status == status
    assert e.body() == {"error": {"message": "why", "type": kind, "param": None, "code": code.name}}


def test_fields_and_messages_are_renamed_to_the_clients_names():
    completion = parse_completion({"prompt": [1, 2]}, "r").params
    chat = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}, "r"
    ).params
    bad = grpc.StatusCode.INVALID_ARGUMENT
    e = from_failure(
        RequestFailed(bad, "sampling.temperature must be >= 0, got -1.0", "sampling.temperature"), chat
    )
    assert (e.param, e.message) == ("temperature", "temperature must be >= 0, got -1.0")
    e = from_failure(
        RequestFailed(bad, "token_ids[1] = 5000 is not below vocab_size 1024", "token_ids[1]"), completion
    )
    assert (e.param, e.message) == ("prompt[1]", "prompt[1] = 5000 is not below vocab_size 1024")
    msg = "prompt length 5 + max_new_tokens 2000 = 2005 exceeds max_model_len 1024"
    e = from_failure(RequestFailed(bad, msg, "max_new_tokens"), chat)
    assert e.param == "max_completion_tokens" and e.message.startswith(
        "prompt length 5 + max_completion_tokens 2000"
    )
    e = from_failure(
        RequestFailed(bad, "top_logprobs 30 is above the limit of 20", "top_logprobs"), completion
    )
    assert (e.param, e.message) == ("logprobs", "logprobs 30 is above the limit of 20")
    e = from_failure(RequestFailed(bad, "messages[0].role is 'robot'; ...", "messages[0].role"), chat)
    assert e.param == "messages[0].role"
    # Other fields the message mentions get the client's names too.
    msg = "sampling.min_tokens 5 is above max_new_tokens 4"
    e = from_failure(RequestFailed(bad, msg, "sampling.min_tokens"), chat)
    assert (e.param, e.message) == ("min_tokens", "min_tokens 5 is above max_completion_tokens 4")


# ---- responses ----


def tok(token_id, text, logprob, top=()):
    return pb.Logprobs(
        chosen=pb.TokenLogprob(token_id=token_id, text=text, logprob=logprob),
        top=[pb.TokenLogprob(token_id=i, text=t, logprob=lp) for i, t, lp in top],
    )


def responses(finish=pb.FINISH_REASON_EOS, logprobs=False):
    lp = [tok(5, "Hel", -0.5, [(5, "Hel", -0.5), (6, "He", -1.5)]), tok(6, "lo", float("-inf"))]
    usage = pb.Usage(prompt_tokens=4, completion_tokens=3)
    return [
        pb.GenerateResponse(request_id="r", token_ids=[5, 6], text="Hello", logprobs=lp if logprobs else []),
        pb.GenerateResponse(request_id="r", token_ids=[7], text="", finish_reason=finish, usage=usage),
    ]


def test_whole_completion_has_openais_shape():
    req = parse_completion({"prompt": "x", "logprobs": 1}, "r")
    out = Encoder(req, "tiny", created=123).whole(responses(logprobs=True))
    assert out == {
        "id": "cmpl-r",
        "object": "text_completion",
        "created": 123,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "Hello",
                "logprobs": {
                    "tokens": ["Hel", "lo"],
                    "token_logprobs": [-0.5, -9999.0],  # -inf is not JSON
                    "top_logprobs": [{"Hel": -0.5}, {}],
                    "text_offset": [0, 3],
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    }
    json.dumps(out, allow_nan=False)


def test_whole_chat_has_openais_shape():
    req = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, "r"
    )
    out = Encoder(req, "smollm2", created=1).whole(responses(finish=pb.FINISH_REASON_LENGTH, logprobs=True))
    assert out["id"] == "chatcmpl-r" and out["object"] == "chat.completion"
    (choice,) = out["choices"]
    assert (
        choice["message"] == {"role": "assistant", "content": "Hello"} and choice["finish_reason"] == "length"
    )
    first = choice["logprobs"]["content"][0]
    assert first == {
        "token": "Hel",
        "logprob": -0.5,
        "bytes": [72, 101, 108],
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
            {"token": "He", "logprob": -1.5, "bytes": [72, 101]},
        ],
    }
    assert out["usage"]["total_tokens"] == 7


def test_chat_stream_chunks():
    req = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "r",
    )
    enc = Encoder(req, "m", created=1)
    [role] = enc.role_chunks()
    assert role["object"] == "chat.completion.chunk" and role["usage"] is None
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first, last = (enc.chunk(r) for r in responses(finish=pb.FINISH_REASON_STOP))
    assert (
        first["choices"][0]["delta"] == {"content": "Hello"} and first["choices"][0]["finish_reason"] is None
    )
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    usage = enc.usage_chunk(responses()[1].usage)
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
    }


def test_completion_stream_chunks_skip_held_back_text_and_carry_offsets_across_chunks():
    req = parse_completion({"prompt": "x", "stream": True, "logprobs": 0}, "r")
    enc = Encoder(req, "m", created=1)
    no_logprobs = Encoder(parse_completion({"prompt": "x", "stream": True}, "r"), "m")
    assert no_logprobs.chunk(pb.GenerateResponse(token_ids=[1], text="")) is None  # text held back
    a = enc.chunk(pb.GenerateResponse(token_ids=[1], text="ab", logprobs=[tok(1, "ab", -1.0)]))
    b = enc.chunk(pb.GenerateResponse(token_ids=[2], text="c", logprobs=[tok(2, "c", -2.0)]))
    assert a["choices"][0]["logprobs"]["text_offset"] == [0] and b["choices"][0]["logprobs"][
        "text_offset"
    ] == [2]
    assert "usage" not in a  # only with stream_options.include_usage


# ---- the HTTP server over a scripted Frontend ----


class FakeFrontend:
    """Frontend's surface as OpenAIServer uses it. script(request) is the async generator to run."""

    def __init__(self, script):
        self.config = SimpleNamespace(
            model="models/fake",
            enable_lora=False,
            lora_modules=(),
            served_model_name=(),
            reasoning_parser=None,
        )
        self.pool = SimpleNamespace(ready=True)
        self.loras = LoRANames(self.config, self.pool, RequestFailed)
        self.script = script
        self.requests: list[pb.GenerateRequest] = []
        self.started = asyncio.Event()
        self.closed = asyncio.Event()  # set when the generator's finally ran (the real one aborts there)

    def model_info(self):
        return pb.ModelInfo(model_name="fake", max_model_len=64)

    async def generate(self, request, parent=None):
        self.requests.append(request)
        self.started.set()
        try:
            async for resp in self.script(request):
                yield resp
        finally:
            self.closed.set()


async def two_responses(request):
    for r in responses():
        yield r


async def forever_after_one(request):
    yield responses()[0]
    await asyncio.Event().wait()


async def forever(request):
    await asyncio.Event().wait()
    yield  # pragma: no cover


def failing(code, message="no", after_first=False):
    async def script(request):
        if after_first:
            yield responses()[0]
        raise RequestFailed(code, message)
        yield  # pragma: no cover

    return script


def serve(script, test, *, frontend_cls=None, **kw):
    """Runs test(session, base_url, frontend, server) against an OpenAIServer on a free port. frontend_cls:
    FakeFrontend or a subclass; kw: the server's options."""

    async def main():
        frontend = (frontend_cls or FakeFrontend)(script)
        server = OpenAIServer(frontend, **kw)
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                return await test(session, f"http://127.0.0.1:{port}", frontend, server)
        finally:
            await server.stop()

    return asyncio.run(main())


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n")
    chunks = text.split("\n\n")[:-2]
    assert all(c.startswith("data: ") for c in chunks)
    return [json.loads(c.removeprefix("data: ")) for c in chunks]


def test_http_completion_whole_and_streamed():
    async def test(session, url, frontend, server):
        async with session.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "x"}) as r:
            assert r.status == 200
            whole = await r.json()
        body = {
            "model": "models/fake",
            "prompt": "x",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await r.text())
        return whole, events

    whole, events = serve(two_responses, test)
    assert whole["choices"][0]["text"] == "Hello" and whole["usage"]["total_tokens"] == 7
    assert [e["choices"][0]["text"] for e in events[:2]] == ["Hello", ""]
    assert events[1]["choices"][0]["finish_reason"] == "stop"
    assert events[2]["choices"] == [] and events[2]["usage"]["completion_tokens"] == 3


def test_http_x_request_id_is_the_request_id():
    async def test(session, url, frontend, server):
        headers = {"X-Request-Id": "abc-1"}
        async with session.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=headers) as r:
            return (await r.json())["id"], frontend.requests[0].request_id

    assert serve(two_responses, test) == ("cmpl-abc-1", "abc-1")


def test_http_chat_stream_starts_with_the_role():
    async def test(session, url, frontend, server):
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            return sse_events(await r.text())

    events = serve(two_responses, test)
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
        {},
    ]


def test_http_failures_before_the_first_token_are_statuses_even_when_streaming():
    async def test(session, url, frontend, server):
        body = {"model": "fake", "prompt": "x", "stream": True}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            return r.status, await r.json()

    status, body = serve(failing(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), test)
    assert status == 429
    assert body["error"] == {
        "message": "queue full",
        "type": "rate_limit_error",
        "param": None,
        "code": "RESOURCE_EXHAUSTED",
    }


def test_http_failure_after_the_first_token_is_an_error_event():
    async def test(session, url, frontend, server):
        body = {"model": "fake", "prompt": "x", "stream": True}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            return r.status, sse_events(await r.text())

    status, events = serve(failing(grpc.StatusCode.UNAVAILABLE, "replica lost", after_first=True), test)
    assert status == 200
    assert events[0]["choices"][0]["text"] == "Hello"
    assert events[1] == {
        "error": {"message": "replica lost", "type": "server_error", "param": None, "code": "UNAVAILABLE"}
    }


def test_http_unknown_model_bad_json_and_unknown_path():
    async def test(session, url, frontend, server):
        out = []
        async with session.post(f"{url}/v1/completions", json={"model": "gpt-4", "prompt": "x"}) as r:
            out.append((r.status, (await r.json())["error"]["param"]))
        async with session.post(f"{url}/v1/completions", data=b"{not json") as r:
            out.append((r.status, (await r.json())["error"]["code"]))
        async with session.get(f"{url}/v1/nothing") as r:
            out.append((r.status, (await r.json())["error"]["type"]))
        return out, len(frontend.requests)

    out, reached = serve(two_responses, test)
    assert out == [(404, "model"), (400, "INVALID_ARGUMENT"), (404, "invalid_request_error")]
    assert reached == 0


def test_http_models_and_health():
    async def test(session, url, frontend, server):
        async with session.get(f"{url}/v1/models") as r:
            models = await r.json()
        async with session.get(f"{url}/health") as r:
            ready = r.status
        frontend.pool.ready = False
        async with session.get(f"{url}/health") as r:
            not_ready = r.status
        frontend.pool.ready = True
        server.draining = True
        async with session.get(f"{url}/health") as r:
            draining = r.status
        async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as r:
            refused = r.status
        return models, ready, not_ready, draining, refused

    models, *statuses = serve(two_responses, test)
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake"]
    assert statuses == [200, 503, 503, 503]


def test_http_keys_are_required_except_for_health():
    refused = []

    async def test(session, url, frontend, server):
        out = []
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            async with session.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=headers) as r:
                body = await r.json()
                out.append((r.status, body["error"]["type"], r.headers.get("WWW-Authenticate")))
                assert "s3cret" not in json.dumps(body) and "wrong" not in body["error"]["message"]
        async with session.get(f"{url}/v1/models", headers={}) as r:
            out.append(r.status)
        lora = {"lora_name": "x", "lora_path": "/x"}
        for path in ("load_lora_adapter", "unload_lora_adapter"):  # vLLM's runtime LoRA endpoints
            async with session.post(f"{url}/v1/{path}", json=lora) as r:
                out.append(r.status)
        async with session.get(f"{url}/health") as r:
            out.append(r.status)
        ok = {"Authorization": "Bearer s3cret"}
        async with session.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=ok) as r:
            out.append(r.status)
        async with session.post(f"{url}/v1/load_lora_adapter", json=lora, headers=ok) as r:
            out.append((r.status, (await r.json())["error"]["message"]))
        return out, len(frontend.requests)

    out, reached = serve(two_responses, test, keys=ApiKeys(["s3cret"]), on_refused=lambda: refused.append(1))
    assert out[:3] == [(401, "authentication_error", "Bearer")] * 3
    assert out[3:-1] == [401, 401, 401, 200, 200]
    assert out[-1] == (400, "the server was started without --enable-lora")
    assert reached == 1 and len(refused) == 6


@pytest.mark.parametrize("script", [forever_after_one, forever], ids=["streaming", "before-first-token"])
def test_a_client_that_disconnects_closes_the_frontends_generator(script):
    async def test(session, url, frontend, server):
        body = {"model": "fake", "prompt": "x", "stream": True}
        response = asyncio.ensure_future(session.post(f"{url}/v1/completions", json=body))
        await asyncio.wait_for(frontend.started.wait(), 10)
        if script is forever_after_one:
            r = await response
            assert (await r.content.readuntil(b"\n\n")).startswith(b"data: ")
            r.close()  # drops the connection
        else:
            response.cancel()  # the request was sent; nothing came back yet
        assert not frontend.closed.is_set()
        # Bounded only so that a broken build fails instead of hanging: the close is immediate.
        await asyncio.wait_for(frontend.closed.wait(), 10)
        return True

    assert serve(script, test)


def test_http_with_the_grpc_ports_tls_files_refuses_plaintext_and_clients_without_a_certificate(pki):
    """--tls-* cover the HTTP port too: it is never a plaintext side door to a TLS server."""
    tls = TlsFiles(cert=pki["server"], key=pki["server_key"], ca=pki["ca"])

    def client_tls(cert: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=pki["ca"])
        if cert:
            ctx.load_cert_chain(pki[cert], pki[f"{cert}_key"])
        return ctx

    async def test(session, url, frontend, server):
        https = url.replace("http://", "https://")
        async with session.get(f"{https}/health", ssl=client_tls("client")) as r:
            out = [r.status]
        for attempt in (dict(url=f"{url}/health"), dict(url=f"{https}/health", ssl=client_tls(None))):
            try:
                async with session.get(**attempt) as r:
                    out.append(r.status)
            except aiohttp.ClientError:
                out.append("refused")
        return out

    assert serve(two_responses, test, tls=tls) == [200, "refused", "refused"]
