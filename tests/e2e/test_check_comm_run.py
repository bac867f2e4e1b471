"""tpserve check-comm through the real CLI: two gloo ranks on this CPU, figures that add up."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_two_gloo_ranks_report_sane_figures(tmp_path):
    out = tmp_path / "comm.json"
    cmd = [sys.executable, "-m", "common.cli", "check-comm", "--world-size", "2", "--device", "cpu"]
    cmd += ["--dtype", "float32", "--hidden-size", "256", "--max-num-seqs", "16", "--num-layers", "4"]
    cmd += ["--iters", "3", "--max-bytes", str(1 << 20), "--out", str(out)]
    # A CPU and gloo are far below the GPU limits: the verdict fails (exit 1), and says so.
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 1, run.stderr
    assert "FAIL" in run.stdout and "busbw" in run.stdout
    doc = json.loads(out.read_text())
    samples = doc["samples"]
    assert [s["bytes"] for s in samples] == sorted(s["bytes"] for s in samples)
    assert samples[0]["bytes"] == 256 * 4 and samples[-1]["bytes"] == 1 << 20
    for s in samples:
        assert s["seconds"] > 0
        assert abs(s["algbw_gbps"] - s["bytes"] / s["seconds"] / 1e9) < 1e-9
        assert abs(s["busbw_gbps"] - s["algbw_gbps"]) < 1e-9  # 2 (n - 1) / n = 1 for two ranks
    assert doc["verdict"]["step_allreduce_ms"] > 0 and not doc["verdict"]["link_ok"]
