"""The OpenAI-compatible aiohttp server (router/openai/server.py) over a scripted stand-in for the
Frontend: SSE framing, errors before and after the stream starts, keys, health, TLS, and a client that
disconnects closing the Frontend's generator. The bodies' and answers' translation:
tests/unit/test_openai_protocol.py."""

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
from router.openai.server import OpenAIServer
from tests.unit.test_openai_protocol import responses

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
