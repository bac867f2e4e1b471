"""Metrics and traces through the real processes: what operators and tracing dashboards see."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.reference import GREEDY, generate, run_concurrently

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def scrape(port: int) -> dict[str, float]:
    """Every sample of a /metrics page as {name{labels}: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def read_trace(path, trace_id: str, want: int, timeout: float = 30.0) -> list[dict]:
    """One trace's spans. They are exported in batches: wait (bounded) until `want` have arrived."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        spans = [
            s for s in map(json.loads, filter(None, lines)) if s["context"]["trace_id"] == f"0x{trace_id}"
        ]
        if len(spans) >= want or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    flags = ("--metrics-port", "0", "--trace-file", str(trace_file))
    with launch(tiny_model, *flags) as (target, info), grpc.insecure_channel(target) as channel:
        yield generation_pb2_grpc.GenerationStub(channel), info, trace_file


def test_metrics_count_what_clients_received(stack):
    stub, info, _ = stack
    ports = info["metrics_ports"]
    assert set(ports) == {"router", "scheduler", "shard-worker rank 0"}
    before = scrape(ports["router"])
    reqs = [
        dict(text="hello " * (n + 1), max_new_tokens=3 + n, ignore_eos=True, sampling=GREEDY)
        for n in range(6)
    ]
    results = run_concurrently(stub, reqs)
    received = sum(len(tokens) for tokens, *_ in results)
    prompt = sum(last.usage.prompt_tokens for *_, last in results)

    router = scrape(ports["router"])
    assert (
        router["tpserve_generation_tokens_total"] - before.get("tpserve_generation_tokens_total", 0)
        == received
    )
    assert router["tpserve_prompt_tokens_total"] - before.get("tpserve_prompt_tokens_total", 0) == prompt
    assert router["tpserve_requests_finished_total{reason=length}"] >= 6
    assert router["tpserve_time_to_first_token_seconds_count"] >= 6
    assert router["tpserve_e2e_request_latency_seconds_count"] >= 6
    # Every token after a request's first is one inter-token gap.
    assert router["tpserve_inter_token_latency_seconds_count"] >= received - 6

    sched = scrape(ports["scheduler"])
    assert sched["tpserve_kv_blocks_used"] == 0 and sched["tpserve_kv_blocks_total"] > 0
    assert sched["tpserve_num_requests_running"] == 0 and sched["tpserve_num_requests_waiting"] == 0
    assert sched["tpserve_queue_time_seconds_count"] >= 6
    assert sched["tpserve_batch_size_count"] == sched["tpserve_step_duration_seconds_count"] > 0
    # Tokens computed over all steps: every prompt token and every generated token but each last one.
    assert sched["tpserve_batch_tokens_sum"] >= prompt + received - 6

    worker = scrape(ports["shard-worker rank 0"])
    assert (
        worker["tpserve_worker_forward_duration_seconds_count"]
        == sched["tpserve_step_duration_seconds_count"]
    )
    assert worker["tpserve_device_memory_used_bytes{device=cpu,rank=0}"] > 0


def test_bad_requests_are_counted_by_code(stack):
    stub, info, _ = stack
    with pytest.raises(grpc.RpcError):
        generate(stub, text="", max_new_tokens=1)
    assert (
        scrape(info["metrics_ports"]["router"])["tpserve_requests_failed_total{code=INVALID_ARGUMENT}"] >= 1
    )


def test_one_trace_from_the_client_through_every_process(stack):
    stub, _, trace_file = stack
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    for _ in stub.Generate(
        pb.GenerateRequest(text="trace me", max_new_tokens=3, ignore_eos=True, sampling=GREEDY),
        metadata=[("traceparent", traceparent)],
    ):
        pass
    # 1 router + 1 scheduler.request + 1 queue + 3 steps + 3 forwards.
    spans = read_trace(trace_file, CLIENT_TRACE_ID, want=9)
    by_name = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    assert set(by_name) >= {"tpserve.Generate", "scheduler.request", "scheduler.queue", "scheduler.step"}
    assert len(by_name["shard_worker.forward"]) == len(by_name["scheduler.step"]) == 3

    def parent_of(span):
        return span["parent_id"]

    [router] = by_name["tpserve.Generate"]
    [request] = by_name["scheduler.request"]
    assert parent_of(router) == f"0x{CLIENT_SPAN_ID}"
    assert parent_of(request) == router["context"]["span_id"]
    assert parent_of(by_name["scheduler.queue"][0]) == request["context"]["span_id"]
    steps = {s["context"]["span_id"] for s in by_name["scheduler.step"]}
    assert all(parent_of(s) == request["context"]["span_id"] for s in by_name["scheduler.step"])
    assert {parent_of(f) for f in by_name["shard_worker.forward"]} == steps
    services = {s["resource"]["attributes"]["service.name"] for s in spans}
    assert services == {"router", "scheduler", "shard-worker-0"}
    assert [e["name"] for e in request["events"]] == ["admitted", "finished"]
    assert all("tpserve.allreduce_seconds" in f["attributes"] for f in by_name["shard_worker.forward"])
