"""The GPU check script (bench/gpu_check.py) at toy sizes on CPU: what a device lease runs is run here."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_gpu_check_runs_every_part_at_toy_sizes(tmp_path):
    out = tmp_path / "gpu-check.json"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--dtype", "float32", "--quick"]
    run = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    ref = doc["reference"]
    assert "error" not in ref, ref
    assert ref["close"] == ref["prompts"] == 8  # greedy tokens as transformers gives them
    bench = doc["benchmark"]
    for batching in ("continuous", "static"):
        part = bench[batching]
        assert part["ok"] == 8 and part["failed"] == 0, part
        assert part["ttft_ms"]["p50"] > 0 and part["tpot_ms"]["p50"] > 0
        assert part["device_memory_gib"]["shard-worker rank 0"] > 0
    assert bench["continuous_over_static"] > 0
