"""The HTTP server's endpoints besides generation, and tool calling end to end through it with the official
`openai` client, over a scripted stand-in for the Frontend (tests/unit/test_openai_api.py's): the shapes
vLLM's protocol files give for /tokenize, /detokenize, /version, /ping, /v1/models/{id}, and the router's
/metrics on the HTTP port."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.frontend import RequestFailed
from router.openai.fields import FIELDS, markdown_table
from tests.conftest import ROOT
from tests.unit.test_openai_api import FakeFrontend, serve

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class Frontend(FakeFrontend):
    """Adds what /tokenize and /detokenize call."""

    async def tokenize(self, request, token_strs=False):
        self.requests.append(request)
        ids = [ord(c) for c in request.text or request.messages[-1].content]
        return ids, [chr(i) for i in ids] if token_strs else None, 64

    async def detokenize(self, ids):
        if any(i >= 1000 for i in ids):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "tokens[0] too big", "tokens[0]")
        return "".join(chr(i) for i in ids)


def scripted(*pieces: str):
    async def script(request):
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield pb.GenerateResponse(
                request_id=request.request_id,
                token_ids=[1],
                text=text,
                finish_reason=pb.FINISH_REASON_EOS if last else 0,
                usage=pb.Usage(prompt_tokens=3, completion_tokens=len(pieces)) if last else None,
            )

    return script


def run(script, test, frontend_cls=Frontend, **kw):
    return serve(script, test, frontend_cls=frontend_cls, **kw)


def test_tokenize_and_detokenize_have_vllms_shapes():
    async def test(session, url, frontend, server):
        out = []
        for body in (
            {"model": "fake", "prompt": "hi", "return_token_strs": True},
            {"messages": [{"role": "user", "content": "yo"}], "add_generation_prompt": False},
        ):
            async with session.post(f"{url}/tokenize", json=body) as r:
                out.append((r.status, await r.json()))
        async with session.post(f"{url}/detokenize", json={"tokens": [104, 105]}) as r:
            out.append((r.status, await r.json()))
        for path, body in (("/detokenize", {"tokens": [5000]}), ("/tokenize", {"prompt": 3})):
            async with session.post(f"{url}{path}", json=body) as r:
                out.append((r.status, (await r.json())["error"]["param"]))
        return out, frontend.requests

    out, requests = run(None, test)
    assert out[0] == (200, {"count": 2, "max_model_len": 64, "tokens": [104, 105], "token_strs": ["h", "i"]})
    assert out[1] == (200, {"count": 2, "max_model_len": 64, "tokens": [121, 111], "token_strs": None})
    assert requests[1].HasField("add_generation_prompt") and not requests[1].add_generation_prompt
    assert out[2] == (200, {"prompt": "hi"})
    assert out[3:] == [(400, "tokens[0]"), (400, "prompt")]


def test_version_ping_metrics_and_one_model():
    registry = CollectorRegistry()
    Counter("tpserve_test_requests", "A counter.", registry=registry).inc(3)

    async def test(session, url, frontend, server):
        out = {}
        for method, path in (
            ("get", "/version"),
            ("get", "/ping"),
            ("post", "/ping"),
            ("get", "/v1/models/fake"),
        ):
            async with session.request(method, f"{url}{path}") as r:
                out[method, path] = (r.status, await r.json())
        async with session.get(f"{url}/v1/models/gpt-4o") as r:
            out["other"] = (r.status, (await r.json())["error"]["code"])
        async with session.get(f"{url}/metrics") as r:
            out["metrics"] = (r.status, r.headers["Content-Type"], await r.text())
        return out

    out = run(None, test, metrics_registry=registry)
    status, body = out["get", "/version"]
    assert status == 200 and set(body) == {"version"} and body["version"]
    assert out["get", "/ping"] == out["post", "/ping"] == (200, {"status": "SERVING"})
    status, card = out["get", "/v1/models/fake"]
    assert (
        status == 200 and card["id"] == "fake" and card["object"] == "model" and card["root"] == "models/fake"
    )
    assert out["other"] == (404, "NOT_FOUND")
    status, kind, text = out["metrics"]
    assert status == 200 and kind.startswith("text/plain") and "tpserve_test_requests_total 3.0" in text


def test_any_path_to_the_served_directory_is_the_served_model(tmp_path):
    """The bug (issue 19): only the exact --model string was accepted as a path."""
    served = tmp_path / "models" / "fake"
    served.mkdir(parents=True)
    (tmp_path / "link").symlink_to(served)

    class AtPath(Frontend):
        def __init__(self, script):
            super().__init__(script)
            self.config.model = str(tmp_path / "models" / "fake")

    names = [
        str(served),
        str(served) + "/",
        str(tmp_path / "models" / ".." / "models" / "fake"),
        str(tmp_path / "link"),
    ]

    async def test(session, url, frontend, server):
        out = []
        for name in [*names, str(tmp_path / "models")]:
            async with session.post(f"{url}/v1/completions", json={"model": name, "prompt": "x"}) as r:
                out.append(r.status)
        return out

    assert run(scripted("ok"), test, frontend_cls=AtPath) == [200, 200, 200, 200, 404]


def chat_client(url) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    "pieces", [[CALL], [CALL[:5], CALL[5:30], CALL[30:]]], ids=["one-piece", "three-pieces"]
)
def test_tool_calls_reach_the_official_client_whole_and_streamed(pieces):
    async def test(session, url, frontend, server):
        client = chat_client(url)
        kw = dict(
            model="fake", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL]
        )
        whole = await client.chat.completions.create(**kw)
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
        return whole, chunks, frontend.requests[0]

    whole, chunks, request = run(scripted(*pieces), test, tool_call_parser="hermes")
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Streamed: tool_calls deltas with an index; no stray content; the last chunk says tool_calls.
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [t.name for t in request.tools] == ["get_weather"]
    assert json.loads(request.tools[0].parameters_json)["required"] == ["city"]


def test_tool_choice_none_and_a_history_with_a_tool_result():
    async def test(session, url, frontend, server):
        client = chat_client(url)
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
        ]
        answer = await client.chat.completions.create(
            model="fake", messages=messages, tools=[WEATHER_TOOL], tool_choice="none"
        )
        return answer, frontend.requests[0]

    answer, request = run(scripted(CALL), test)  # no parser configured: "none" needs none
    assert answer.choices[0].message.content == CALL and answer.choices[0].finish_reason == "stop"
    assistant, tool = request.messages[1], request.messages[2]
    assert [(c.id, c.name, json.loads(c.arguments_json)) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", {"city": "Paris"})
    ]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "18C and sunny")


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (dict(tool_choice="auto"), "tool_choice", "--tool-call-parser"),
        (
            dict(
                tool_choice="auto",
                tools=[WEATHER_TOOL | {"function": WEATHER_TOOL["function"] | {"strict": True}}],
            ),
            "tools[0].function.strict",
            "only when tool_choice forces",
        ),
        (
            dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "not one of the tools",
        ),
    ],
)
def test_tool_choices_that_cannot_be_honoured_are_400(extra, param, words):
    async def test(session, url, frontend, server):
        body = {
            "model": "fake",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER_TOOL],
            **extra,
        }
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            return r.status, (await r.json())["error"]

    status, error = run(scripted("x"), test)
    assert status == 400 and error["param"] == param and words in error["message"]


def test_the_docs_list_every_request_field_as_fields_py_declares_it():
    page = (ROOT / "docs" / "reference" / "openai-fields.md").read_text()
    assert markdown_table() in page
    assert len({f.name for f in FIELDS}) == len(FIELDS)
