"""A shard worker's start-up, through the real process: it reports its phases with their times, and a
second start with the same compile cache (--compile-cache-dir) loads its kernels instead of compiling.

The cache is the user's default one that every other test's worker also fills, so in a full run both
starts here usually find it warm: what is asserted is that the second start compiles nothing and loads
as many kernels as the first start built or loaded (the warm-up's), not how long either took.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc

from common.grpc_util import read_port_file
from common.pb.tpserve.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import ROOT

DESCRIBE = worker_pb2.DescribeRequest(
    block_size=16, cpu_kv_cache_gib=0.01, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256
)


def start_and_describe(model, port_file, cache_dir) -> worker_pb2.DescribeResponse:
    """Starts a worker, asks it to Describe itself (which sizes its cache and warms it up), stops it."""
    cmd = [sys.executable, "-m", "common.cli", "shard-worker", "--model", str(model), "--port", "0"]
    cmd += ["--port-file", str(port_file), "--compile-cache-dir", str(cache_dir)]
    # flex: the backend that compiles at start-up (the default cpu backend's kernel is built once per
    # machine, not per start: tests/unit/test_cpu_kernel.py). It runs float32 only: --dtype auto would be
    # bf16 on a CPU with native bf16.
    cmd += ["--attention-backend", "flex", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = read_port_file(port_file, 180, lambda: proc.poll() is None)["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            return worker_pb2_grpc.ShardWorkerStub(channel).Describe(DESCRIBE, timeout=300)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_phases_are_reported_and_a_warm_restart_compiles_nothing(tiny_model, tmp_path):
    from common.speed import StackSpeed
    from shard_worker.startup import DEFAULT_COMPILE_CACHE_DIR

    first = start_and_describe(tiny_model, tmp_path / "first.port", DEFAULT_COMPILE_CACHE_DIR)
    phases = {p.name: p.seconds for p in first.startup_phases}
    # On CPU: no worst-step profile, so sizing is the budget alone; the kernels are compiled while the
    # weights load (compile_kernels, reported once the scheduler's Describe has waited for it), then the
    # whole model is warmed, then timed (for the router's admission: common/speed.py).
    assert list(phases) == ["load_weights", "compile_kernels", "kv_sizing", "warm_up", "measure_speed"]
    assert StackSpeed.from_message(first).known
    assert all(s >= 0 for s in phases.values()) and phases["compile_kernels"] > 0
    assert first.num_kv_blocks == int(0.01 * 2**30) // first.kv_block_bytes
    # The warm-up built flex attention's kernels, or loaded them from the cache.
    kernels = first.compiled_graphs + first.cached_graphs
    assert kernels >= 2

    second = start_and_describe(tiny_model, tmp_path / "second.port", DEFAULT_COMPILE_CACHE_DIR)
    assert second.compiled_graphs == 0, "a start with a warm compile cache compiled again"
    assert second.cached_graphs == kernels
