"""The Triton attention backend (shard_worker/attention/triton_paged.py), tested on CPU.

- Under Triton's interpreter, in subprocesses (triton_backend_cases.py): the backend against a float64
  naive attention on random steps (with gpt-oss's sinks too, split or not), its split-KV workspace, and
  the decode graphs' padded replay path on the tiny model for every bucket (shard_worker/cuda_graphs.py
  with capture off).
- Here: when the backend refuses to run, and the layers it refuses, each in one line.
"""

from __future__ import annotations

import os

import pytest
import torch

from shard_worker.attention import Attention, select_backend
from tests.unit.test_triton_kernels import HERE, _run_helper

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

CPU = torch.device("cpu")


@pytest.mark.parametrize("case", ["random_steps", "split_workspace", "graph_buckets", "sinks"])
def test_backend_under_the_interpreter(case):
    assert (HERE / "triton_backend_cases.py").is_file()
    for result in _run_helper("triton_backend_cases.py", [case], {**os.environ, "TRITON_INTERPRET": "1"}):
        print(result)


def test_cpu_without_the_interpreter_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^--attention-backend triton: on CPU .* set TRITON_INTERPRET=1"):
        select_backend("triton", CPU, torch.float32)


def test_the_interpreter_switched_on_after_the_kernels_were_imported(monkeypatch):
    import shard_worker.attention.kernels  # noqa: F401  (imported here without TRITON_INTERPRET)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="TRITON_INTERPRET changed after"):
        select_backend("triton", CPU, torch.float32)


def test_float64_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="float16, bfloat16 or float32, not float64"):
        select_backend("triton", CPU, torch.float64)


@pytest.mark.parametrize(
    "layer, message",
    [
        (Attention(8, 8, 512, 0.1), "head_dim 512 exceeds the kernels' 256"),
        (Attention(256, 1, 64, 0.1), "256 query heads per KV head exceed the kernels' 128"),
    ],
)
def test_layers_the_kernels_cannot_run(layer, message):
    from shard_worker.attention.triton_paged import TritonBackend

    assert message in TritonBackend(CPU, torch.float32).unsupported_layer(layer)
    assert TritonBackend(CPU, torch.float32).unsupported_layer(Attention(32, 8, 128, 0.1)) is None
