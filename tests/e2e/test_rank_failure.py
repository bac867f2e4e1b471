"""A rank whose tensor-parallel group breaks leaves, non-zero and saying why, so that whatever runs it (the
launcher, Kubernetes) rebuilds the group; run here without the launcher, as Kubernetes runs the ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import grpc
import pytest

from common.grpc_util import ReservedPort, read_port_file, wait_for_health
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import ROOT


@contextlib.contextmanager
def processes():
    started: list[subprocess.Popen] = []

    def start(args, log):
        proc = subprocess.Popen(
            [sys.executable, "-m", "common.cli", "--log-level", "WARNING", *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_a_rank_whose_peer_died_exits_with_the_reason(tiny_model, tmp_path):
    with ReservedPort() as rendezvous, processes() as start:
        dist_init = f"127.0.0.1:{rendezvous.port}"
        ranks, logs = [], []
        for rank in range(2):
            logs.append(tmp_path / f"rank{rank}.log")
            args = ["shard-worker", "--model", str(tiny_model), "--rank", str(rank), "--world-size", "2"]
            args += ["--dist-init", dist_init, "--port", "0", "--port-file", str(tmp_path / f"w{rank}.port")]
            ranks.append(start(args, logs[-1].open("wb")))
        ports = [
            read_port_file(tmp_path / f"w{r}.port", 180, lambda r=r: ranks[r].poll() is None)["port"]
            for r in range(2)
        ]
        sched_args = ["scheduler", "--port", "0", "--port-file", str(tmp_path / "s.port")]
        for port in ports:
            sched_args += ["--worker", f"127.0.0.1:{port}"]
        scheduler = start(sched_args, (tmp_path / "scheduler.log").open("wb"))
        sched_port = read_port_file(tmp_path / "s.port", 60, lambda: scheduler.poll() is None)["port"]
        router_args = ["router", "--model", str(tiny_model), "--scheduler", f"127.0.0.1:{sched_port}"]
        router = start(
            router_args + ["--port", "0", "--port-file", str(tmp_path / "r.port")],
            (tmp_path / "router.log").open("wb"),
        )
        target = f"127.0.0.1:{read_port_file(tmp_path / 'r.port', 60, lambda: router.poll() is None)['port']}"
        wait_for_health(target, 180)
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            assert list(stub.Generate(pb.GenerateRequest(text="hi", max_new_tokens=2, ignore_eos=True)))
            os.kill(ranks[1].pid, signal.SIGKILL)
            # The next step needs rank 1: rank 0's collective fails, and rank 0 leaves.
            stream = stub.Generate(
                pb.GenerateRequest(text="after", max_new_tokens=2, ignore_eos=True), timeout=5
            )
            with contextlib.suppress(grpc.RpcError):
                list(stream)
        try:
            code = ranks[0].wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 is still running with a broken group")
        assert code == 1
        out = logs[0].read_text()
        assert "tpserve shard-worker: rank 0:" in out and "exiting so that the group is rebuilt" in out
        assert scheduler.poll() is None and router.poll() is None  # they wait for the ranks to return
