"""Length buckets and admission control through the real processes (the router decides who goes next)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch

# One sequence at a time in the scheduler, and none waiting there: the router's queue holds the rest.
ONE_AT_A_TIME = ("--max-num-seqs", "1", "--admission-window", "1")


def first_token_times(stub, requests: list[dict], stagger_s: float = 0.0) -> list[float]:
    """Sends the requests in order (each a little after the previous) and returns when each one's
    first token arrived; every request must then run to completion."""
    times = [0.0] * len(requests)

    def run(i):
        stream = stub.Generate(pb.GenerateRequest(**requests[i]), timeout=120)
        next(stream)
        times[i] = time.monotonic()
        assert list(stream)[-1].finish_reason == pb.FINISH_REASON_LENGTH

    threads = []
    for i in range(len(requests)):
        t = threading.Thread(target=run, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(stagger_s)
    for t in threads:
        t.join()
    assert all(times)
    return times


def blocker() -> dict:
    """Holds the only slot long enough for every later request to be queued in the router."""
    return dict(token_ids=[5] * 4, max_new_tokens=250, ignore_eos=True)


def test_short_requests_sent_after_a_long_one_start_first(tiny_model):
    flags = (*ONE_AT_A_TIME, "--max-queue-wait-ms", "600000")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        long = dict(token_ids=[7] * 600, max_new_tokens=2, ignore_eos=True)
        shorts = [dict(token_ids=[9] * (3 + i), max_new_tokens=2, ignore_eos=True) for i in range(20)]
        times = first_token_times(stub, [blocker(), long, *shorts], stagger_s=0.01)
        assert max(times[2:]) < times[1]


def test_a_long_request_is_not_starved_by_a_stream_of_short_ones(tiny_model):
    flags = (*ONE_AT_A_TIME, "--max-queue-wait-ms", "300")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        long = dict(token_ids=[7] * 600, max_new_tokens=2, ignore_eos=True)
        shorts = [dict(token_ids=[9] * 4, max_new_tokens=8, ignore_eos=True) for _ in range(40)]
        times = first_token_times(stub, [blocker(), long, *shorts], stagger_s=0.02)
        # Shorts kept arriving, yet once it had waited past the bound the long one went ahead of them.
        assert sum(t > times[1] for t in times[2:]) >= 10


def test_a_burst_beyond_capacity_gets_resource_exhausted_at_once(tiny_model):
    flags = ("--max-num-seqs", "2", "--admission-window", "2", "--max-queued-requests", "8")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        def one(i):
            try:
                resps = list(
                    stub.Generate(pb.GenerateRequest(text=f"burst {i}", max_new_tokens=40, ignore_eos=True))
                )
                return sum(len(r.token_ids) for r in resps)
            except grpc.RpcError as e:
                return e.code()

        with ThreadPoolExecutor(48) as pool:
            results = list(pool.map(one, range(48)))
        done = [r for r in results if r == 40]
        refused = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(done) + len(refused) == 48  # nothing else: every request completed or was refused
        assert len(refused) >= 48 - 2 * (8 + 2 + 2)
        stats = stub.GetStats(pb.StatsRequest())
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_waiting == 0
        assert [b.name for b in stats.buckets] == ["0-511", "512-2047", "2048+"]


def test_operator_caps_on_prompt_and_output_length(tiny_model):
    flags = ("--max-prompt-tokens", "50", "--max-new-tokens-limit", "8")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for kw, field in (
            (dict(token_ids=[9] * 51, max_new_tokens=2), "token_ids"),
            (dict(token_ids=[9] * 5, max_new_tokens=9), "max_new_tokens"),
        ):
            try:
                list(stub.Generate(pb.GenerateRequest(**kw)))
                raise AssertionError(f"{kw} was accepted")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.details()
        ok = list(stub.Generate(pb.GenerateRequest(token_ids=[9] * 50, max_new_tokens=8, ignore_eos=True)))
        assert sum(len(r.token_ids) for r in ok) == 8
