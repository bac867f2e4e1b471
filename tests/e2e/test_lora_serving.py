"""LoRA adapters through the real processes (`tpserve launch`), against transformers + peft's greedy
tokens (float64) with the same adapter: two random adapters written by peft (all seven projections at
rank 8 with rsLoRA; attention only at rank 16) and the base model, every reference prompt on each, all
at once in one batch. --max-loras 1 makes one adapter wait for the other (base-model requests pass it);
chunked prefill (64 tokens a step), preemption (16 KV blocks) and the prefix cache are forced. Then the
adapter names on the OpenAI API, and unknown ones refused; adapters unloaded and loaded while requests
stream, and refused at runtime load (the same server); and --tp 2 on one adapter. Refusals at start-up
are tests/unit/test_lora.py's."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.lora_adapters import ATTENTION, copy_adapter, hf_lora_greedy, make_adapter, narrower
from tests.reference import GREEDY, MAX_NEW, run_concurrently

FLAGS = ("--dtype", "float64", "--max-num-batched-tokens", "64", "--num-kv-blocks", "16")
# Reference prompts served here (tests/reference.py's lengths): short, a block and one, chunked ones.
LENS = (3, 17, 90, 130)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_adapter(tiny_model, root / "sql", seed=1, rank=8, alpha=16, rslora=True),
        "chat": make_adapter(tiny_model, root / "chat", seed=2, rank=16, alpha=32, targets=ATTENTION),
    }


@pytest.fixture(scope="module")
def references(tiny_model, adapters, reference):
    base = {ids: out for ids, out in reference.items() if len(ids) in LENS}
    return {"": base} | {name: hf_lora_greedy(tiny_model, path, LENS) for name, path in adapters.items()}


def lora_flags(adapters) -> tuple[str, ...]:
    return ("--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()))


def assert_served(stub, references) -> None:
    reqs = [
        dict(token_ids=ids, max_new_tokens=MAX_NEW, ignore_eos=True, sampling=GREEDY, lora_name=name)
        for name, ref in references.items()
        for ids in ref
    ]
    results = iter(run_concurrently(stub, reqs))
    for name, ref in references.items():
        for ids, want in ref.items():
            tokens, _, reason, _ = next(results)
            assert tokens == want, f"adapter {name!r}, prompt of {len(ids)} tokens"
            assert reason == pb.FINISH_REASON_LENGTH


def test_adapters_and_base_in_one_batch_serve_transformers_peft_tokens(
    tiny_model, adapters, references, tmp_path
):
    flags = (*FLAGS, *lora_flags(adapters), "--max-loras", "1", "--enable-prefix-caching", "--http-port", "0")
    with launch(tiny_model, *flags) as (target, info), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert references["sql"] != references[""] and references["chat"] != references[""]
        assert_served(stub, references)
        assert_served(stub, references)  # again: prompts now in the prefix cache, per adapter
        stats = stub.GetStats(pb.StatsRequest())
        assert stats.num_preemptions_total > 0
        assert stats.kv_blocks_free == stats.kv_blocks_total
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(token_ids=[5, 6], max_new_tokens=2, lora_name="nope")))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details()

        http = f"http://127.0.0.1:{info['http_port']}/v1"
        with urllib.request.urlopen(f"{http}/models", timeout=10) as r:
            cards = {c["id"]: c for c in json.load(r)["data"]}
        base = next(c for c in cards.values() if c["parent"] is None)
        assert cards["sql"]["parent"] == cards["chat"]["parent"] == base["id"]
        assert cards["sql"]["root"] == str(adapters["sql"])
        ids = next(iter(references["sql"]))
        body = {
            "model": "sql",
            "prompt": list(ids),
            "max_tokens": MAX_NEW,
            "temperature": 0,
            "ignore_eos": True,
        }
        with urllib.request.urlopen(_post(f"{http}/completions", body), timeout=60) as r:
            answer = json.load(r)
        assert answer["model"] == "sql"
        assert answer["usage"]["completion_tokens"] == MAX_NEW
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(_post(f"{http}/completions", body | {"model": "nope"}), timeout=60)
        assert e.value.code == 404 and "nope" in e.value.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{info['http_port']}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        served = 2 * len(LENS) + 1  # two rounds of the prompts, and the completion
        assert f'tpserve_lora_requests_total{{lora_name="sql"}} {served}.0' in metrics
        assert 'tpserve_lora_requests_in_flight{lora_name="chat"} 0.0' in metrics
        assert "nope" not in metrics
        check_loading_while_serving(stub, http, adapters, references, tmp_path)
        check_an_adapter_whose_files_vanished(stub, http, adapters, references, tmp_path, info)


class Streams:
    """Greedy requests on one adapter, each in its own thread, started once each has had a token; twice
    the reference's tokens, so that they are still running (results: the reference's length of them)."""

    def __init__(self, stub, name: str, refs: dict):
        self.pool = ThreadPoolExecutor(len(refs))
        self.first = threading.Semaphore(0)
        self.futures = {ids: self.pool.submit(self._one, stub, name, ids) for ids in refs}
        for _ in refs:
            assert self.first.acquire(timeout=120), "a request got no first token"

    def _one(self, stub, name, ids):
        req = pb.GenerateRequest(
            token_ids=ids, max_new_tokens=2 * MAX_NEW, ignore_eos=True, sampling=GREEDY, lora_name=name
        )
        tokens = []
        for resp in stub.Generate(req, timeout=120):
            if not tokens:
                self.first.release()
            tokens += resp.token_ids
        assert len(tokens) == 2 * MAX_NEW
        return tokens[:MAX_NEW]

    def results(self) -> dict:
        out = {ids: f.result() for ids, f in self.futures.items()}
        self.pool.shutdown()
        return out


def check_loading_while_serving(stub, http: str, adapters, references, tmp) -> None:
    """Unload `chat` while requests on it stream (they finish with peft's tokens; new ones get 404 /
    NOT_FOUND), load the same weights as `chat2` while base-model requests stream, and refuse a missing
    path, a rank above --max-lora-rank, another base's shapes and a name already loaded, losing nothing:
    then base, sql and chat2 requests in one batch still serve peft's tokens. --max-loras 1 and the
    default --max-cpu-loras (1) evict each adapter from the host and read it again at every switch."""
    streams = Streams(stub, "chat", references["chat"])
    unloaded = stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="chat"))
    assert unloaded.requests_finishing >= 1  # all four, unless one finished before the unload
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(token_ids=[5, 6], max_new_tokens=2, lora_name="chat")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert streams.results() == references["chat"]

    streams = Streams(stub, "", references[""])
    body = {"lora_name": "chat2", "lora_path": str(adapters["chat"])}
    with urllib.request.urlopen(_post(f"{http}/load_lora_adapter", body), timeout=60) as r:
        assert r.status == 200 and "chat2" in r.read().decode()
    assert streams.results() == references[""]

    def refused(body, status: int) -> str:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(_post(f"{http}/load_lora_adapter", body), timeout=60)
        assert e.value.code == status
        return json.load(e.value)["error"]["message"]

    sql = adapters["sql"]
    assert "expected adapter_config.json" in refused({"lora_name": "x", "lora_path": str(tmp)}, 404)
    high = copy_adapter(sql, tmp / "r64", config={"r": 64})
    assert "rank 64 is above --max-lora-rank 16" in refused({"lora_name": "x", "lora_path": str(high)}, 400)
    other = copy_adapter(sql, tmp / "other", tensors=narrower)
    assert "another base model" in refused({"lora_name": "x", "lora_path": str(other)}, 400)
    assert "already loaded" in refused(body, 409)
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="y", lora_path=str(tmp / "none")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="chat"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    with urllib.request.urlopen(f"{http}/models", timeout=10) as r:
        cards = {c["id"]: c for c in json.load(r)["data"]}
    assert set(cards) - {c["id"] for c in cards.values() if c["parent"] is None} == {"sql", "chat2"}
    assert cards["chat2"]["root"] == str(adapters["chat"])
    assert_served(stub, {"": references[""], "sql": references["sql"], "chat2": references["chat"]})


def check_an_adapter_whose_files_vanished(stub, http: str, adapters, references, tmp, info) -> None:
    """An adapter deleted from disk while it is served, once evicted from the ranks' host caches (--max-
    cpu-loras 1: the next adapter used evicts it): its requests get NOT_FOUND / 404 naming it, and the
    ranks live on, serving the others. Before, the step that read it again ended the rank."""

    def first(name: str) -> dict:  # one reference prompt of each: the point is not the tokens here
        return dict([next(iter(references[name].items()))])

    path = copy_adapter(adapters["sql"], tmp / "vanishing")
    stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="vanishing", lora_path=str(path)))
    assert_served(stub, {"vanishing": first("sql")})
    assert_served(stub, {"chat2": first("chat")})  # evicts it from the host
    shutil.rmtree(path)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(token_ids=[5, 6], max_new_tokens=2, lora_name="vanishing")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'vanishing'" in e.value.details()
    body = {"model": "vanishing", "prompt": [5, 6], "max_tokens": 2}
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(_post(f"{http}/completions", body), timeout=60)
    assert e.value.code == 404 and "vanishing" in e.value.read().decode()
    for name, pid in info["pids"].items():  # every process of the stack is the one that started
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state != "Z", f"{name} (pid {pid}) ended"
    assert_served(stub, {"": first(""), "sql": first("sql")})


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})


def test_adapter_at_tp2_serves_transformers_peft_tokens(tiny_model, adapters, references):
    subset = {name: references[name] for name in ("", "sql")}
    with launch(tiny_model, *FLAGS, *lora_flags(adapters), "--tp", "2") as (target, _):
        with grpc.insecure_channel(target) as channel:
            assert_served(generation_pb2_grpc.GenerationStub(channel), subset)
