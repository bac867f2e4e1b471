"""A short `tpserve bench` against a real tiny stack: the harness end to end (no time is asserted)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from bench import cli as bench_cli
from bench.client_run import bench_server
from bench.metrics import RUN_KEYS
from bench.workload import build_requests
from tests.conftest import launch
from tests.unit.test_bench import SHORT, _no_nan


def test_short_bench_against_a_tiny_stack(tiny_model, tmp_path):
    with launch(tiny_model) as (target, info):
        run, extra, results = asyncio.run(
            bench_server(target, SHORT, 6, slo_ttft_ms=60_000, pids=info["pids"], progress=False)
        )
        p = argparse.ArgumentParser()
        bench_cli.add_arguments(p)
        out = tmp_path / "bench.json"
        args = ["--target", target, "--num-requests", "4", "--request-rate", "50", "--prompt-max", "24"]
        args += ["--output-mean", "6", "--output-max", "12", "--no-progress", "--out", str(out)]
        assert bench_cli.main(p.parse_args(args)) == 0
    assert extra["errors"] == [] and extra["completed"] == 6 and extra["failed"] == 0
    assert extra["length_mismatches"] == 0  # ignore_eos: exactly the workload's lengths
    want = build_requests(SHORT, 6, vocab_size=1024, seed=0, exclude_ids=(1,))
    assert extra["total_output_tokens"] == sum(r.max_new_tokens for r in want)
    assert all(0 < r.ttft_s <= r.e2e_s for r in results)
    assert run["output_tokens_per_s"] > 0 and run["requests_per_s"] > 0
    assert run["goodput_rps"] == pytest.approx(run["requests_per_s"])  # a 60 s SLO everything meets
    assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"] and run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
    assert set(run["peak_rss_mb"]) == set(info["pids"]) and all(v > 0 for v in run["peak_rss_mb"].values())
    assert 1 <= run["mean_batch_size"] <= 6  # six requests at most in a step
    assert extra["engine"]["num_steps"] >= max(r.max_new_tokens for r in want)
    assert 0 <= extra["engine_overhead_pct"] <= 100
    doc = _no_nan(out.read_text())
    assert [tuple(r) for r in doc["runs"]] == [RUN_KEYS]
    assert doc["details"]["tpserve"]["completed"] == 4
