"""A scheduler killed under load, and no client sees an error: the router resumes each request it held
where it stopped, on the restarted scheduler or another replica (router/pool.py).

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

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_reliability import all_blocks_free, serving, wait_until
from tests.reference import MAX_NEW, assert_matches_reference, run_concurrently

# Two sequences at a time: the other requests wait, so a kill always finds two that have streamed
# tokens (to resume) and others that have not (to resend).
FLAGS = ("--dtype", "float64", "--max-num-seqs", "2")


def kill_when(stub, info, victims: list[str], steps: int = 4):
    """Kills each victim (a process name of the launch) once its scheduler has run `steps` more steps
    with requests running: mid-stream."""

    def go():
        for victim in victims:
            base = _stats(stub).num_steps_total
            wait_until(
                lambda b=base: (s := _stats(stub)).num_running > 0 and s.num_steps_total >= b + steps,
                60,
                f"requests streaming before killing {victim}",
            )
            os.kill(current_pid(info, victim), signal.SIGKILL)

    t = threading.Thread(target=go)
    t.start()
    return t


def resumed(info) -> int:
    """Requests the router resumed after losing their scheduler, from its log."""
    found = re.findall(r"lost \(.*\): (\d+) request\(s\) resumed", info["log"].read_text())
    return sum(int(n) for n in found)


def lost_lines(info) -> str:
    return "\n".join(line for line in info["log"].read_text().splitlines() if "lost" in line)


def _stats(stub) -> pb.Stats:
    try:
        return stub.GetStats(pb.StatsRequest(), timeout=5)
    except grpc.RpcError:
        return pb.Stats()  # the scheduler is being restarted


def current_pid(info, name: str) -> int:
    """The process's pid now: the launcher rewrites its ready file after each restart."""
    return json.loads(info["ready_file"].read_text())["pids"][name]


def test_a_killed_scheduler_costs_no_request_its_tokens(tiny_model, reference):
    with launch(tiny_model, *FLAGS, "--max-restarts", "2") as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            killer = kill_when(stub, info, ["scheduler"])
            assert_matches_reference(stub, reference)  # every token once, in order, and no error
            killer.join()
            wait_until(lambda: all_blocks_free(stub), 30, "blocks free at the end")
            assert resumed(info) >= 1, lost_lines(info)


def test_seeded_sampling_resumes_with_the_tokens_an_undisturbed_run_gives(tiny_model):
    reqs = [
        dict(
            token_ids=[3 + i] * (5 + 7 * i),
            max_new_tokens=MAX_NEW,
            ignore_eos=True,
            sampling=pb.SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, frequency_penalty=0.5),
        )
        for i in range(10)
    ]
    with launch(tiny_model, *FLAGS, "--max-restarts", "2") as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            undisturbed = [r[0] for r in run_concurrently(stub, reqs)]
            killer = kill_when(stub, info, ["scheduler"])
            disturbed = [r[0] for r in run_concurrently(stub, reqs)]
            killer.join()
            assert resumed(info) >= 1, lost_lines(info)  # the kill did catch requests mid-stream
    assert disturbed == undisturbed


def test_a_killed_worker_and_a_killed_scheduler_in_one_run(tiny_model, reference):
    with launch(tiny_model, *FLAGS, "--max-restarts", "4") as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            killer = kill_when(stub, info, ["shard-worker rank 0", "scheduler"])
            assert_matches_reference(stub, reference)
            killer.join()
            assert resumed(info) >= 1, lost_lines(info)
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
