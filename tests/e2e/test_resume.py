"""A scheduler killed under load, and no client sees an error: the router resumes each request it held
where it stopped, on the restarted scheduler or another replica (router/failover.py).

What a user would notice: every stream ends with exactly the tokens an undisturbed run gives (greedy:
transformers'; seeded sampling: the same seed's undisturbed output), each token once, and no status
other than OK; a request that keeps losing its scheduler ends with UNAVAILABLE naming the cap.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_reliability import all_blocks_free, serving, wait_until
from tests.reference import GREEDY, MAX_NEW, run_concurrently

# Two sequences at a time: the other requests wait, so a kill always finds two that have streamed
# tokens (to resume) and others that have not (to resend).
FLAGS = ("--dtype", "float64", "--max-num-seqs", "2")


class Tracked:
    """Requests streamed on threads, with the tokens each client has received so far."""

    def __init__(self, stub, requests: list[dict]):
        self.received = [0] * len(requests)
        self.done = [False] * len(requests)
        self.results: list = [None] * len(requests)
        self.errors: list = []

        def one(i):
            tokens, last = [], None
            try:
                for resp in stub.Generate(pb.GenerateRequest(**requests[i]), timeout=120):
                    tokens += resp.token_ids
                    self.received[i] = len(tokens)
                    last = resp
            except grpc.RpcError as e:
                self.errors.append((i, e.code(), e.details()))
            self.results[i] = (tokens, last)
            self.done[i] = True

        self.threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
        for t in self.threads:
            t.start()

    def join(self):
        for t in self.threads:
            t.join(180)
        return self.results

    def mid_stream(self, since: list[int]) -> bool:
        """Some request still running has received two tokens more than `since` says."""
        return any(r >= s + 2 and not d for r, s, d in zip(self.received, since, self.done, strict=True))


def kill_mid_stream(info, tracked: Tracked, victims: list[str]) -> threading.Thread:
    """Kills each victim (a process name of the launch) while a request is mid-stream: it has received
    tokens, and has more to come."""

    def go():
        for victim in victims:
            since = list(tracked.received)
            deadline = time.monotonic() + 60
            while not tracked.mid_stream(since):  # a tight poll: the window is a few steps wide
                assert time.monotonic() < deadline, f"no request mid-stream to kill {victim}"
                time.sleep(0.002)
            os.kill(current_pid(info, victim), signal.SIGKILL)

    t = threading.Thread(target=go)
    t.start()
    return t


def reference_requests(reference) -> list[dict]:
    return [
        dict(token_ids=ids, max_new_tokens=MAX_NEW, ignore_eos=True, sampling=GREEDY) for ids in reference
    ]


def assert_reference_tokens(results, reference) -> None:
    """Every token once, in order: exactly transformers' greedy continuation."""
    for ids, (tokens, last) in zip(reference, results, strict=True):
        assert tokens == reference[ids], f"prompt of {len(ids)} tokens"
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == MAX_NEW


def resumed(info, since: int = 0) -> int:
    """Requests the router resumed after losing their scheduler, from its log past offset `since`."""
    found = re.findall(r"lost \(.*\): (\d+) request\(s\) resumed", info["log"].read_text()[since:])
    return sum(int(n) for n in found)


def lost_lines(info, since: int = 0) -> str:
    return "\n".join(line for line in info["log"].read_text()[since:].splitlines() if "lost" in line)


@pytest.fixture(scope="module")
def stack(tiny_model):
    """One launch for the tests that kill under load (4 kills in all, so restarts to spare): each test
    starts on a serving stack with every block free, and reads only the log its own kills wrote."""
    with (
        launch(tiny_model, *FLAGS, "--max-restarts", "8") as (target, info),
        grpc.insecure_channel(target) as channel,
    ):
        yield target, info, generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture
def served(stack):
    """(stub, info, log offset) once the shared stack serves again with every block free."""
    target, info, stub = stack
    wait_until(lambda: serving(target), 60, "health SERVING")
    wait_until(lambda: all_blocks_free(stub), 30, "blocks free")
    return stub, info, len(info["log"].read_text())


def _stats(stub) -> pb.Stats:
    try:
        return stub.GetStats(pb.StatsRequest(), timeout=5)
    except grpc.RpcError:
        return pb.Stats()  # the scheduler is being restarted


def current_pid(info, name: str) -> int:
    """The process's pid now: the launcher rewrites its ready file after each restart."""
    return json.loads(info["ready_file"].read_text())["pids"][name]


def test_a_killed_scheduler_costs_no_request_its_tokens(served, reference):
    stub, info, since = served
    tracked = Tracked(stub, reference_requests(reference))
    kill_mid_stream(info, tracked, ["scheduler"]).join()
    results = tracked.join()
    assert tracked.errors == []
    assert_reference_tokens(results, reference)
    wait_until(lambda: all_blocks_free(stub), 30, "blocks free at the end")
    assert resumed(info, since) >= 1, lost_lines(info, since)


def test_seeded_sampling_resumes_with_the_tokens_an_undisturbed_run_gives(served):
    reqs = [
        dict(
            token_ids=[3 + i] * (5 + 7 * i),
            max_new_tokens=MAX_NEW,
            ignore_eos=True,
            sampling=pb.SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, frequency_penalty=0.5),
        )
        for i in range(10)
    ]
    stub, info, since = served
    undisturbed = [r[0] for r in run_concurrently(stub, reqs)]
    tracked = Tracked(stub, reqs)
    kill_mid_stream(info, tracked, ["scheduler"]).join()
    disturbed = [r[0] for r in tracked.join()]
    assert tracked.errors == []
    assert resumed(info, since) >= 1, lost_lines(info, since)  # the kill did catch requests mid-stream
    assert disturbed == undisturbed


def test_a_killed_worker_and_a_killed_scheduler_in_one_run(stack, served, reference):
    target, *_ = stack
    stub, info, since = served
    tracked = Tracked(stub, reference_requests(reference))
    kill_mid_stream(info, tracked, ["shard-worker rank 0", "scheduler"]).join()
    results = tracked.join()
    assert tracked.errors == []
    assert_reference_tokens(results, reference)
    assert resumed(info, since) >= 1, lost_lines(info, since)
    wait_until(lambda: serving(target), 60, "health SERVING again")
    wait_until(lambda: all_blocks_free(stub), 30, "blocks free at the end")


def test_a_request_past_the_attempt_cap_ends_unavailable_naming_it(tiny_model):
    flags = ("--max-restarts", "3", "--max-request-attempts", "2")
    with launch(tiny_model, *flags) as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            stream = stub.Generate(pb.GenerateRequest(text="long", max_new_tokens=1000, ignore_eos=True))
            assert next(stream).token_ids  # on its first scheduler
            first = current_pid(info, "scheduler")
            os.kill(first, signal.SIGKILL)
            second = wait_until(lambda: (p := current_pid(info, "scheduler")) != first and p, 30, "a new pid")
            # Resumed on the restarted scheduler (attempt 2 of 2): it runs there.
            wait_until(
                lambda: _stats(stub).num_running == 1, 30, "the request running on the restarted scheduler"
            )
            assert next(stream).token_ids
            os.kill(second, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as e:
                for _ in stream:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--max-request-attempts 2" in e.value.details()
