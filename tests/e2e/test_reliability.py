"""Faults injected through the real processes: cancellation, a killed shard or scheduler, a drain.

The goal in every case is that no accepted request is lost: each ends with its tokens or a status.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.reference import GREEDY, assert_matches_reference, generate, run_concurrently


def wait_until(predicate, timeout: float, what: str):
    """Polls for a state the system must reach; the bound only keeps a broken build from hanging."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout}s: {what}")


def all_blocks_free(stub) -> bool:
    s = stub.GetStats(pb.StatsRequest())
    return s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 and s.num_waiting == 0


def serving(target) -> bool:
    with grpc.insecure_channel(target) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stack(tiny_model):
    with launch(tiny_model, "--dtype", "float64") as (target, info):
        with grpc.insecure_channel(target) as channel:
            yield generation_pb2_grpc.GenerationStub(channel), target, info


def test_cancelled_requests_free_every_block_50_times(stack):
    stub, _, _ = stack
    for round_ in range(50):
        streams = [
            stub.Generate(pb.GenerateRequest(text=f"long {round_} {i}", max_new_tokens=900, ignore_eos=True))
            for i in range(16)
        ]
        for s in streams:
            next(s)  # every request is running and holds blocks
        assert (
            stub.GetStats(pb.StatsRequest()).kv_blocks_free < stub.GetStats(pb.StatsRequest()).kv_blocks_total
        )
        for s in streams:
            s.cancel()
        wait_until(lambda: all_blocks_free(stub), 5.0, f"blocks freed after cancelling, round {round_}")


def test_a_passed_deadline_frees_the_blocks(stack):
    stub, _, _ = stack
    with pytest.raises(grpc.RpcError) as e:
        for _ in stub.Generate(
            pb.GenerateRequest(text="slow", max_new_tokens=900, ignore_eos=True), timeout=0.5
        ):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: all_blocks_free(stub), 5.0, "blocks freed after the deadline")


def test_64_concurrent_greedy_requests_give_what_each_gives_alone(stack):
    stub, _, _ = stack
    reqs = [
        dict(text="the quick brown fox " * (1 + i % 7) + str(i), max_new_tokens=8 + i % 13, sampling=GREEDY)
        for i in range(64)
    ]
    alone = [generate(stub, **kw)[0] for kw in reqs[:16]]
    together = [tokens for tokens, *_ in run_concurrently(stub, reqs)]
    assert together[:16] == alone
    assert together[16:] == [generate(stub, **kw)[0] for kw in reqs[16:]]


@pytest.mark.parametrize("call", ["Describe", "InitCache"])
def test_a_second_scheduler_cannot_reset_a_worker_another_is_stepping(stack, reference, call):
    """Before, only Step refused a second scheduler: its Describe dropped the KV caches and its InitCache
    forgot every sequence under the scheduler stepping the worker."""
    from common.grpc_util import SCHEDULER_METADATA_KEY
    from common.pb.tpserve.internal.v1 import worker_pb2, worker_pb2_grpc

    stub, _, info = stack
    request = {
        "Describe": worker_pb2.DescribeRequest(block_size=16, num_kv_blocks=8),
        "InitCache": worker_pb2.InitCacheRequest(num_blocks=8, block_size=16, max_model_len=64),
    }[call]
    with grpc.insecure_channel(info["workers"][0]) as channel:
        worker = worker_pb2_grpc.ShardWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            getattr(worker, call)(request, metadata=((SCHEDULER_METADATA_KEY, "intruder"),), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is stepping it" in e.value.details() and "intruder" in e.value.details()
    prompt, expected = next(iter(reference.items()))
    kw = dict(token_ids=list(prompt), max_new_tokens=len(expected), ignore_eos=True, sampling=GREEDY)
    assert generate(stub, **kw)[0] == expected


def kill_mid_load(tiny_model, reference, victim: str, *flags: str):
    """Starts the reference prompts, SIGKILLs `victim` once tokens flow, and checks every request still
    ends with exactly the reference tokens: the scheduler kept them and recomputed."""
    with launch(tiny_model, "--dtype", "float64", "--max-restarts", "2", *flags) as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            seen_down = []

            def kill_when_running():
                wait_until(lambda: stub.GetStats(pb.StatsRequest()).num_running > 0, 30, "requests running")
                os.kill(info["pids"][victim], signal.SIGKILL)
                # Health says so while the shard is down (the router has no replica up) ...
                seen_down.append(wait_until(lambda: not serving(target), 30, "health NOT_SERVING"))

            killer = threading.Thread(target=kill_when_running)
            killer.start()
            assert_matches_reference(stub, reference)
            killer.join()
            assert seen_down == [True]
            wait_until(lambda: serving(target), 60, "health SERVING again")  # ... and once it is back
            assert generate(stub, text="after", max_new_tokens=2, ignore_eos=True)[0]
            wait_until(lambda: all_blocks_free(stub), 5.0, "blocks free at the end")


def test_killed_shard_worker_is_restarted_and_no_request_is_lost(tiny_model, reference):
    kill_mid_load(tiny_model, reference, "shard-worker rank 0")


def test_killed_rank_of_a_tp2_group_restarts_the_group_and_no_request_is_lost(tiny_model, reference):
    kill_mid_load(tiny_model, reference, "shard-worker rank 1", "--tp", "2")


def test_a_worker_killed_while_idle_then_the_scheduler_killed_come_back(tiny_model):
    """One stack, two restarts. SIGKILL of the only rank while nothing runs: the scheduler's health
    turns NOT_SERVING (it used to stay SERVING until the next request happened to hit the dead stream),
    and SERVING again once the launcher's restarted rank is initialised; then it serves, and the
    scheduler survived the loss. Then SIGKILL of the scheduler: a request sent while no replica is up
    waits in the router for the restarted scheduler, and the router is the original process."""
    with launch(tiny_model, "--max-restarts", "2") as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            assert generate(stub, text="before", max_new_tokens=3, ignore_eos=True)[0]
            wait_until(lambda: all_blocks_free(stub), 10, "idle")
            os.kill(info["pids"]["shard-worker rank 0"], signal.SIGKILL)
            wait_until(lambda: not serving(info["scheduler"]), 30, "the scheduler NOT_SERVING")
            wait_until(lambda: serving(info["scheduler"]), 60, "the scheduler SERVING again")
            wait_until(lambda: serving(target), 30, "the router SERVING again")
            tokens, _, reason, _ = generate(stub, text="after", max_new_tokens=3, ignore_eos=True)
            assert len(tokens) == 3 and reason == pb.FINISH_REASON_LENGTH
            os.kill(info["pids"]["scheduler"], 0)  # the scheduler survived the loss: no restart needed
            wait_until(lambda: all_blocks_free(stub), 5.0, "blocks free at the end")

            os.kill(info["pids"]["scheduler"], signal.SIGKILL)
            wait_until(lambda: not serving(target), 30, "health NOT_SERVING while no scheduler is up")
            # Sent while no replica is up: it waits in the router for the restarted scheduler.
            tokens, _, reason, _ = generate(stub, text="during", max_new_tokens=3, ignore_eos=True)
            assert len(tokens) == 3 and reason == pb.FINISH_REASON_LENGTH
            wait_until(lambda: serving(target), 30, "health SERVING again")
            os.kill(info["pids"]["router"], 0)  # still the original router process


def test_sigterm_drains_requests_in_flight_then_exits_cleanly(tiny_model):
    with launch(tiny_model) as (target, info):
        launcher = info["launcher"]
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            streams = [
                stub.Generate(pb.GenerateRequest(text=f"drain {i}", max_new_tokens=60, ignore_eos=True))
                for i in range(4)
            ]
            for s in streams:
                next(s)
            launcher.send_signal(signal.SIGTERM)
            for s in streams:
                last = list(s)[-1]
                assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 60
            with pytest.raises(grpc.RpcError) as e:
                generate(stub, text="too late", max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert launcher.wait(60) == 0


def test_requests_still_running_at_the_drain_timeout_end_with_aborted(tiny_model):
    with launch(tiny_model, "--drain-timeout-s", "0.5") as (target, info):
        launcher = info["launcher"]
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            stream = stub.Generate(pb.GenerateRequest(text="long", max_new_tokens=1000, ignore_eos=True))
            received = len(next(stream).token_ids)
            launcher.send_signal(signal.SIGTERM)
            responses = list(stream)  # ends with a message, not a status
            received += sum(len(r.token_ids) for r in responses)
            last = responses[-1]
            assert last.finish_reason == pb.FINISH_REASON_ABORTED
            assert 0 < received < 1000 and last.usage.completion_tokens == received
        assert launcher.wait(60) == 0
