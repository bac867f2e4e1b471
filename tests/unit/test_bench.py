"""The benchmark harness: seeded workloads, latency arithmetic, the results schema, and a short real run.

No test asserts a time: figures are checked for consistency (ttft <= e2e, counts), never for speed.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from bench import cli as bench_cli
from bench.client_run import step_figures
from bench.metrics import RUN_KEYS, STAT_KEYS, RequestResult, meets_slo, stats_ms, summarize
from bench.report import SCHEMA, format_table, plot, write_json
from bench.workload import WORKLOADS, WorkloadSpec, build_requests, sample_arrivals, sample_lengths
from common.pb.tpserve.v1 import generation_pb2

CHAT = WORKLOADS["chat"]
BIG = 20_000  # samples for the distribution checks: tolerances below are several standard errors wide


# ---- workload generator -------------------------------------------------------------------------------


def test_same_seed_same_requests_other_seed_others():
    a = build_requests(CHAT, 50, vocab_size=1000, seed=7, request_rate=5.0)
    b = build_requests(CHAT, 50, vocab_size=1000, seed=7, request_rate=5.0)
    c = build_requests(CHAT, 50, vocab_size=1000, seed=8, request_rate=5.0)
    assert a == b
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]


def test_rate_changes_arrivals_but_not_the_requests():
    poisson = build_requests(CHAT, 50, vocab_size=1000, seed=3, request_rate=2.0)
    burst = build_requests(CHAT, 50, vocab_size=1000, seed=3)
    assert [(r.prompt_ids, r.max_new_tokens) for r in poisson] == [
        (r.prompt_ids, r.max_new_tokens) for r in burst
    ]
    assert all(r.arrival_s == 0.0 for r in burst)
    assert poisson[-1].arrival_s > 0


def test_chat_prompt_lengths_are_uniform_over_16_to_256():
    prompt, _ = sample_lengths(CHAT, BIG, seed=0)
    assert prompt.min() == 16 and prompt.max() == 256
    # Kolmogorov-Smirnov distance to the discrete uniform CDF; ~0.0096 is the 1% critical value at n=20000.
    values = np.arange(16, 257)
    empirical = np.searchsorted(np.sort(prompt), values, side="right") / BIG
    assert np.abs(empirical - (values - 15) / 241).max() < 0.015


def test_output_lengths_are_exponential_mean_96_capped_at_256():
    _, out = sample_lengths(CHAT, BIG, seed=1)
    assert out.min() >= 1 and out.max() == 256
    cap_share = math.exp(-255.5 / 96)  # P(round(X) >= 256) for X ~ Exp(mean 96)
    assert abs((out == 256).mean() - cap_share) < 0.01
    assert abs(np.median(out) - 96 * math.log(2)) < 3
    assert abs(out.mean() - 96 * (1 - math.exp(-256 / 96))) < 2.5  # mean of min(X, 256)


def test_mixed_prompts_span_50_to_1024():
    prompt, _ = sample_lengths(WORKLOADS["mixed"], BIG, seed=2)
    assert prompt.min() == 50 and prompt.max() == 1024
    assert abs(prompt.mean() - 537) < 8


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_mean_one_over_rate_and_gamma_spread(burstiness):
    rate = 10.0
    gaps = np.diff(sample_arrivals(BIG, rate, burstiness, seed=4))
    assert abs(gaps.mean() - 1 / rate) < 0.05 / rate
    # Gamma(shape k): coefficient of variation 1/sqrt(k); 1 for Poisson, larger when burstier.
    assert abs(gaps.std() / gaps.mean() - 1 / math.sqrt(burstiness)) < 0.1 / math.sqrt(burstiness)


def test_prompt_ids_avoid_excluded_ids_and_stay_in_vocab():
    reqs = build_requests(CHAT, 200, vocab_size=64, seed=5, exclude_ids=(1, 2))
    ids = np.concatenate([r.prompt_ids for r in reqs])
    assert ids.min() >= 0 and ids.max() < 64
    assert not np.isin(ids, [1, 2]).any()


def test_requests_fit_max_model_len():
    reqs = build_requests(WORKLOADS["mixed"], 300, vocab_size=100, seed=6, max_model_len=300)
    assert all(len(r.prompt_ids) + r.max_new_tokens <= 300 and r.max_new_tokens >= 1 for r in reqs)


def test_bad_workloads_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="prompt length"):
        WorkloadSpec("x", prompt_min=10, prompt_max=5, output_mean=10, output_max=10)
    with pytest.raises(ValueError, match="request rate"):
        sample_arrivals(3, 0.0, 1.0, seed=0)


# ---- metrics arithmetic on hand-made timings ------------------------------------------------------------


def _result(send, chunks, end=None, error=None, prompt=8):
    end = chunks[-1][0] if end is None and chunks else end
    return RequestResult(prompt_tokens=prompt, send_time=send, chunks=list(chunks), end_time=end, error=error)


def test_per_request_ttft_tpot_itl_e2e():
    r = _result(10.0, [(10.1, 1), (10.15, 1), (10.3, 2)], end=10.3)
    assert r.output_tokens == 4
    assert r.ttft_s == pytest.approx(0.1)
    assert r.e2e_s == pytest.approx(0.3)
    assert r.tpot_s == pytest.approx(0.2 / 3)  # (e2e - ttft) / (tokens - 1)
    assert r.itl_s == pytest.approx([0.05, 0.15])  # a message of two tokens is one gap
    assert _result(0.0, [(0.5, 1)]).tpot_s is None


def test_percentiles_interpolate_linearly():
    s = stats_ms([0.1, 0.2, 0.3, 0.4])
    assert s == pytest.approx({"mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0})
    assert stats_ms([]) == dict.fromkeys(STAT_KEYS)


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        _result(0.0, [(0.05, 1), (0.15, 1), (0.25, 1)]),  # ttft 50 ms, tpot 100 ms: meets both
        _result(0.0, [(0.5, 1), (0.55, 1)]),  # ttft 500 ms: misses TTFT
        _result(0.0, [(0.05, 1), (0.45, 1)]),  # tpot 400 ms: misses TPOT
        _result(0.0, [(0.05, 1)]),  # one token: no TPOT, meets it
        _result(0.0, [], end=None, error="UNAVAILABLE: gone"),  # failed: never good
    ]
    assert [meets_slo(r, 200, 150) for r in results] == [True, False, False, True, False]
    run = summarize("x", "chat", results, duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert run["goodput_rps"] == pytest.approx(1.0)  # 2 good requests in 2 s
    assert run["requests_per_s"] == pytest.approx(2.0)  # 4 completed
    assert run["output_tokens_per_s"] == pytest.approx(4.0)  # 3 + 2 + 2 + 1 tokens
    assert summarize("x", "chat", results, duration_s=2.0)["goodput_rps"] is None  # no SLO given
    only_ttft = summarize("x", "chat", results, duration_s=2.0, slo_ttft_ms=200)
    assert only_ttft["goodput_rps"] == pytest.approx(1.5)


def test_duration_runs_from_first_send_to_last_completion():
    results = [_result(1.0, [(1.5, 1)], end=2.0), _result(1.5, [(2.0, 1)], end=3.0)]
    run = summarize("x", "chat", results)
    assert run["requests_per_s"] == pytest.approx(1.0)
    assert run["e2e_ms"]["p50"] == pytest.approx(1250.0)


def test_step_figures_diff_two_stats_snapshots():
    before = generation_pb2.Stats(num_steps_total=10, batched_seqs_total=40, batched_tokens_total=400)
    before.step_seconds_total, before.forward_seconds_total = 1.0, 0.5
    after = generation_pb2.Stats(num_steps_total=30, batched_seqs_total=120, batched_tokens_total=1000)
    after.step_seconds_total, after.forward_seconds_total = 3.0, 2.1
    fig = step_figures(before, after)
    assert fig["mean_batch_size"] == pytest.approx(4.0)  # 80 sequences over 20 steps
    assert fig["mean_tokens_per_step"] == pytest.approx(30.0)
    assert fig["mean_step_ms"] == pytest.approx(100.0)
    assert fig["engine_overhead_pct"] == pytest.approx(20.0)  # 0.4 s of 2 s outside the forward
    assert step_figures(after, after)["mean_batch_size"] is None


# ---- results schema -----------------------------------------------------------------------------------


def _no_nan(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_run_object_has_exactly_the_documented_keys(tmp_path):
    results = [_result(0.0, [(0.1, 1), (0.2, 1)]), _result(0.0, [(0.3, 1)])]
    run = summarize("tpserve", "chat", results, slo_ttft_ms=500, peak_rss_mb={"router": 100.0})
    assert tuple(run) == RUN_KEYS
    assert RUN_KEYS == (
        "name",
        "workload",
        "output_tokens_per_s",
        "requests_per_s",
        "ttft_ms",
        "tpot_ms",
        "itl_ms",
        "e2e_ms",
        "goodput_rps",
        "peak_rss_mb",
        "mean_batch_size",
    )
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert tuple(run[key]) == STAT_KEYS
    path = tmp_path / "r.json"
    write_json(path, [run], {"tpserve": {"completed": 2}}, {"seed": 0})
    doc = _no_nan(path.read_text())
    assert doc["schema"] == SCHEMA
    assert [tuple(r) for r in doc["runs"]] == [RUN_KEYS]
    assert doc["runs"][0]["peak_rss_mb"] == {"router": 100.0}


def test_table_shows_ratios_and_runs_that_did_not_run(tmp_path):
    a = summarize("a", "chat", [_result(0.0, [(0.1, 1), (1.0, 1)])])
    b = summarize("b", "chat", [_result(0.0, [(0.1, 1), (2.0, 1)])])
    c = summarize("c", "chat", [])
    table = format_table(
        [a, b, c], {"c": {"error": "RuntimeError: no CPU support"}}, {"a": "a", "b": "a", "c": "a"}
    )
    assert "1.00x" in table and "0.50x" in table
    assert "not run: RuntimeError: no CPU support" in table
    png = tmp_path / "f.png"
    plot(png, [a, b], {"a": {"samples_ms": {"ttft": [1.0, 2.0], "tpot": [1.0], "e2e": [3.0]}}})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_flags_parse_and_override_ranges():
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    a = p.parse_args(
        ["--workload", "mixed", "--request-rate", "inf", "--prompt-max", "600", "--output-max", "64"]
    )
    assert math.isinf(a.request_rate)
    spec = bench_cli.workload_from_args(a)
    assert (spec.prompt_min, spec.prompt_max, spec.output_max) == (50, 600, 64)
    with pytest.raises(SystemExit):
        p.parse_args(["--request-rate", "0"])


# ---- the in-process transformers baselines, on the tiny model -----------------------------------------


SHORT = WorkloadSpec("short", prompt_min=4, prompt_max=24, output_mean=6, output_max=12)


@pytest.mark.parametrize("system", ["padded", "continuous"])
def test_transformers_baselines_honour_output_lengths(tiny_model, system):
    from bench import baselines

    model = baselines.load_model(str(tiny_model))
    reqs = baselines.workload_for(model, SHORT, 5, seed=0, rate=math.inf, burstiness=1.0)
    if system == "padded":
        results, rows = baselines.run_padded(model, reqs, batch_size=2)
        steps = [max(r.max_new_tokens for r in reqs[i : i + 2]) for i in (0, 2, 4)]  # batches of 2, 2, 1
        assert rows == pytest.approx((2 * steps[0] + 2 * steps[1] + steps[2]) / sum(steps))
    else:
        results = baselines.run_continuous(model, reqs)
    assert [r.output_tokens for r in results] == [r.max_new_tokens for r in reqs]
    assert all(r.ok and 0 <= r.ttft_s <= r.e2e_s for r in results)


def test_goodput_takes_vllm_bench_serve_form():
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    a = p.parse_args(["--goodput", "ttft:2000", "tpot:200"])
    bench_cli.apply_goodput(a)
    assert (a.slo_ttft_ms, a.slo_tpot_ms) == (2000.0, 200.0)
    for bad in (["e2el:100"], ["ttft:0"], ["ttft"]):
        with pytest.raises(ValueError, match="--goodput"):
            bench_cli.apply_goodput(p.parse_args(["--goodput", *bad]))


def test_gpu_check_skips_the_quantized_parts_when_the_budget_is_short():
    from bench.gpu_check import skip_reason

    assert skip_reason("quant", "cuda", 200) is None and skip_reason("quant_reference", "cuda", 200) is None
    assert "quant needs 60" in skip_reason("quant", "cuda", 59)
    assert "quant_reference needs 150" in skip_reason("quant_reference", "cuda", 100)
    assert skip_reason("quant", "cpu", 10) is None  # toy sizes take seconds
    assert skip_reason("benchmark", "cuda", 1) is None and skip_reason("benchmark", "cuda", 0) is not None


def test_kv_capacity_of_a_linear_attention_hybrid_is_3x_a_cache_for_every_layer(tmp_path):
    """bench/kv_capacity.py on the test's Qwen3-Next (3 Gated DeltaNet layers, 1 attention layer): at
    a fixed budget the scheduler's pool and slots hold at least 3x the 1,024-token sequences that the
    same model with a KV cache for every layer would."""
    import torch

    from bench import kv_capacity
    from tests.model_families import build_checkpoint

    path = build_checkpoint("qwen3_next", tmp_path)
    (name, _, _, full), (hybrid_name, _, _, hybrid) = kv_capacity.capacity(
        str(path), 0.01, [1024], 16, torch.float32, max_num_seqs=128
    )
    assert (name, hybrid_name) == ("every layer full", "state + attention")
    assert full >= 5 and hybrid >= 3 * full
