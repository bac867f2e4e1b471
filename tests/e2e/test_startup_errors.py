"""Every start-up misconfiguration ends with one line naming it on stderr, no traceback, and exit 2,
through the real processes: each server alone, and `tpserve launch` reporting its own checks and its
children's. The GPU-only cases (fewer GPUs than --tp, bfloat16 without native support) are the rules
of shard_worker/devices.py, tested in tests/unit/test_devices.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

CONFIG_ERROR = 2  # common/cli.py main: what every misconfiguration exits with
no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


def tpserve(
    *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "common.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def error_line(proc: subprocess.CompletedProcess, process: str) -> str:
    """The one line a process ended with: its exit code and the absence of a traceback checked."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == CONFIG_ERROR, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tpserve {process}: "), proc.stderr
    return last


def only_line(proc: subprocess.CompletedProcess, process: str) -> str:
    """A server alone prints nothing else."""
    line = error_line(proc, process)
    assert proc.stderr.strip() == line, proc.stderr
    return line


@pytest.fixture
def checkpoint(tiny_model, tmp_path):
    """Makes a broken copy of the tiny model: its JSON files, and its weights as given."""

    def make(config: str | None = "copy", weights: bytes | None = None) -> Path:
        for f in tiny_model.glob("*.json"):
            shutil.copy(f, tmp_path)
        if config != "copy":
            (tmp_path / "config.json").unlink()
            if config is not None:
                (tmp_path / "config.json").write_text(config)
        if weights is not None:
            (tmp_path / "model.safetensors").write_bytes(weights)
        return tmp_path

    return make


def truncated(tiny_model: Path) -> bytes:
    data = (tiny_model / "model.safetensors").read_bytes()
    return data[: len(data) // 2]


@no_gpu_only
def test_worker_on_cuda_without_a_gpu(tiny_model):
    line = only_line(tpserve("shard-worker", "--model", str(tiny_model), "--device", "cuda"), "shard-worker")
    assert line.endswith("--device cuda: no CUDA device is available on this machine")


def test_worker_with_a_kv_cache_dtype_it_cannot_serve(tiny_model):
    args = [
        "--model",
        str(tiny_model),
        # float32, not auto: auto is bfloat16 on a CPU that multiplies it natively, and a KV cache in
        # the model's own dtype is no refusal.
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "bfloat16",
        "--speculative-model",
        str(tiny_model),
    ]
    line = only_line(tpserve("shard-worker", *args), "shard-worker")
    assert line.endswith(
        "--kv-cache-dtype bfloat16 is not implemented with a --speculative-model: use --kv-cache-dtype auto"
    )


@pytest.mark.parametrize(
    "config, weights, names",
    [
        (None, None, "no config.json there"),
        ('{"model_type": "llama",', None, "config.json: not valid JSON"),
        ("copy", None, "no *.safetensors files there"),
        ("copy", truncated, "model.safetensors: not a readable safetensors file"),
    ],
    ids=["no-config", "corrupt-config", "no-weights", "truncated-weights"],
)
def test_worker_with_an_unreadable_checkpoint(checkpoint, tiny_model, config, weights, names):
    model = checkpoint(config, weights(tiny_model) if weights else None)
    line = only_line(tpserve("shard-worker", "--model", str(model)), "shard-worker")
    assert str(model) in line and names in line


@pytest.mark.parametrize(
    "args",
    [
        ["shard-worker", "--model", "MODEL"],
        ["scheduler", "--worker", "127.0.0.1:1"],
        ["router", "--model", "MODEL", "--scheduler", "127.0.0.1:1"],
    ],
    ids=["shard-worker", "scheduler", "router"],
)
def test_each_server_on_a_port_in_use(tiny_model, held_port, args):
    args = [str(tiny_model) if a == "MODEL" else a for a in args]
    line = only_line(tpserve(*args, "--port", str(held_port)), args[0])
    assert line.endswith(f"port {held_port} is in use on 127.0.0.1 (--port)")


@no_gpu_only
def test_launch_on_cuda_without_a_gpu(tiny_model):
    proc = tpserve("launch", "--model", str(tiny_model), "--device", "cuda", "--port", "0")
    assert error_line(proc, "launch").endswith("--device cuda: no CUDA device is available on this machine")


def test_launch_on_a_port_in_use(tiny_model, held_port):
    proc = tpserve("launch", "--model", str(tiny_model), "--port", str(held_port))
    assert error_line(proc, "launch").endswith(f"port {held_port} is in use on 127.0.0.1 (--port)")


def test_launch_reports_the_error_a_worker_gave_while_starting(checkpoint, tiny_model):
    # config.json passes the launcher's own check; the weights fail in both ranks, after they start.
    model = checkpoint(weights=truncated(tiny_model))
    proc = tpserve("launch", "--model", str(model), "--tp", "2", "--port", "0")
    line = error_line(proc, "launch")
    assert line.startswith("tpserve launch: shard-worker rank ")
    assert f"{model / 'model.safetensors'}: not a readable safetensors file" in line


def test_router_with_an_unreadable_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer_config.json").write_text("{}")  # says a tokenizer is there; there is none
    proc = tpserve("router", "--model", str(tmp_path), "--scheduler", "127.0.0.1:1", "--port", "0")
    line = only_line(proc, "router")
    assert "--model" in line and "tokenizer" in line


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_starting_stops_every_child_at_once(tiny_model, tmp_path, sig):
    """Ctrl-C (or SIGTERM) given to `tpserve launch` while its children start: it stops them and exits,
    without waiting for the stack to serve first (it used to: a minute for SmolLM2)."""
    import os
    import re
    import signal
    import time

    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "common.cli", "--log-level", "INFO", "launch", "--model", str(tiny_model)]
    cmd += ["--port", "0", "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        # Right after the first child starts: it is loading the model, nothing is serving yet.
        while not any("started shard-worker" in line for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        proc.send_signal(getattr(signal, sig))
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines += rest.splitlines(keepends=True)
    assert proc.returncode == 0, "".join(lines)
    assert not ready.exists(), "the stack went on to serve before stopping"
    pids = [int(p) for p in re.findall(r"started [\w -]+ \(pid (\d+)\)", "".join(lines))]
    assert pids
    for pid in pids:  # each child is gone (waited on by the launcher, so no zombie lingers)
        deadline = time.monotonic() + 10
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"child {pid} still running"
            time.sleep(0.05)


def test_worker_with_triton_on_cpu_without_the_interpreter(tiny_model):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = tpserve("shard-worker", "--model", str(tiny_model), "--attention-backend", "triton", env=env)
    line = only_line(proc, "shard-worker")
    assert line.startswith("tpserve shard-worker: --attention-backend triton: on CPU the Triton kernels run")
    assert "set TRITON_INTERPRET=1" in line


def test_worker_refuses_a_head_dim_the_triton_kernels_cannot_hold(tiny_model, tmp_path):
    # A GPU limit (registers) the interpreter would not enforce: refused before the weights load.
    config = json.loads((tiny_model / "config.json").read_text()) | {"head_dim": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ("--model", str(tmp_path), "--attention-backend", "triton", "--load-format", "dummy")
    proc = tpserve("shard-worker", *args, env={**os.environ, "TRITON_INTERPRET": "1"})
    line = only_line(proc, "shard-worker")
    assert line.endswith("model.layers.0.self_attn.attn: head_dim 512 exceeds the kernels' 256 (registers)")
