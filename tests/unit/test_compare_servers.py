"""bench.compare_servers' pure parts: vLLM's random workload, the `vllm bench serve` command, and its
result JSON read into the same run objects as our own client's. No servers, no vLLM."""

from __future__ import annotations

from bench.compare_servers import (
    FIRST_PLAIN_ID,
    levels,
    parser,
    random_requests,
    run_from_vllm_result,
    vllm_bench_command,
)
from bench.metrics import RUN_KEYS, STAT_KEYS
from bench.report import format_table


def test_random_requests_span_vllms_ranges_for_input_and_output():
    requests = random_requests(2000, 128, 64, 0.5, vocab_size=1000, seed=3)
    inputs = [len(p) for p, _ in requests]
    outputs = [m for _, m in requests]
    assert (min(inputs), max(inputs)) == (64, 192)
    assert (min(outputs), max(outputs)) == (32, 96)
    assert all(FIRST_PLAIN_ID <= t < 1000 for p, _ in requests for t in p)
    assert random_requests(5, 128, 64, 0.5, 1000, seed=3) == random_requests(5, 128, 64, 0.5, 1000, seed=3)
    assert random_requests(5, 128, 64, 0.5, 1000, seed=3) != random_requests(5, 128, 64, 0.5, 1000, seed=4)
    assert random_requests(5, 16, 8, 0.0, 1000, seed=1)[0][1] == 8


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_vllm_bench_command_is_the_workload():
    a = parser().parse_args(["--server", "t=http://h:1", "--vllm-bench", "/v/bin/vllm", "--seed", "5"])
    level = levels(a)[1]
    assert (level.label, level.n, level.concurrency, level.rate) == ("c8", 32, 8, None)
    command = vllm_bench_command(a, "http://h:1", "smollm2", level.n, level, "/tmp/x")
    assert command[:3] == ["/v/bin/vllm", "bench", "serve"]
    expected = {
        "--backend": "openai",
        "--base-url": "http://h:1",
        "--endpoint": "/v1/completions",
        "--model": "smollm2",
        "--tokenizer": "models/smollm2",
        "--dataset-name": "random",
        "--random-input-len": "128",
        "--random-output-len": "64",
        "--random-range-ratio": "0.5",
        "--temperature": "0",
        "--num-prompts": "32",
        "--max-concurrency": "8",
        "--seed": "13",
        "--result-dir": "/tmp/x",
        "--result-filename": "result.json",
    }
    assert {k: flag(command, k) for k in expected} == expected
    assert {"--ignore-eos", "--save-result"} <= set(command)
    assert "--request-rate" not in command and "--goodput" not in command and "--lora-modules" not in command


def test_rate_levels_send_one_request_set_at_each_rate_with_goodput_and_adapters():
    argv = ["--server", "t=http://h:1", "--vllm-bench", "vllm", "--request-rate", "2", "4.5"]
    argv += ["--num-requests", "50", "--goodput", "ttft:2000", "tpot:200", "--lora-modules", "a", "b"]
    a = parser().parse_args(argv)
    slow, fast = levels(a)
    assert (slow.label, fast.label) == ("r2", "r4.5")
    assert slow.seed == fast.seed and slow.n == fast.n == 50  # the same prompts and scaled gaps
    command = vllm_bench_command(a, "http://h:1", "m", fast.n, fast, "/tmp/x")
    assert flag(command, "--request-rate") == "4.5" and "--max-concurrency" not in command
    goodput = command.index("--goodput")
    assert command[goodput + 1 : goodput + 3] == ["ttft:2000", "tpot:200"]
    lora = command.index("--lora-modules")
    assert command[lora + 1 : lora + 5] == ["a", "b", "--lora-assignment", "round-robin"]


# What `vllm bench serve --save-result --save-detailed --percentile-metrics ttft,tpot,itl,e2el
# --metric-percentiles 50,90,99` writes (0.32.0), less the per-request lists we do not read.
RESULT = {
    "num_prompts": 4,
    "max_concurrency": 1,
    "duration": 8.0,
    "completed": 3,
    "failed": 1,
    "total_output_tokens": 192,
    "request_throughput": 0.375,
    "output_throughput": 24.0,
    "errors": ["", "Traceback (most recent call last):\n  ...\nHTTP 400: bad\n", "", ""],
    **{
        f"{stat}_{metric}_ms": value
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat, value in (
            ("mean", 11.0),
            ("median", 10.0),
            ("std", 1.0),
            ("p50", 10.0),
            ("p90", 12.0),
            ("p99", 13.0),
        )
    },
}


def test_vllm_result_becomes_a_run_of_our_schema():
    run, details = run_from_vllm_result("vllm c1", RESULT)
    assert tuple(run) == RUN_KEYS
    assert run["output_tokens_per_s"] == 24.0 and run["requests_per_s"] == 0.375
    assert run["goodput_rps"] is None
    assert run_from_vllm_result("v r1", RESULT | {"request_goodput": 0.25})[0]["goodput_rps"] == 0.25
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert tuple(run[key]) == STAT_KEYS
        assert run[key] == {"mean": 11.0, "p50": 10.0, "p90": 12.0, "p99": 13.0}
    assert details == {
        "num_requests": 4,
        "completed": 3,
        "failed": 1,
        "total_output_tokens": 192,
        "duration_s": 8.0,
        "errors": ["HTTP 400: bad"],
    }
    nothing, _ = run_from_vllm_result("vllm c1", RESULT | {"completed": 0})
    assert nothing["ttft_ms"] == dict.fromkeys(STAT_KEYS)
    table = format_table([run], {"vllm c1": details}, {"vllm c1": "vllm c1"})
    assert "3/4" in table and "24.0" in table and "1.00x" in table


def test_a_duration_sizes_each_rate_and_the_missed_objectives_are_counted_apart():
    argv = ["--server", "t=http://h:1", "--vllm-bench", "vllm", "--request-rate", "2", "4.5", "0.01"]
    a = parser().parse_args([*argv, "--duration", "60"])
    assert [(lv.label, lv.n) for lv in levels(a)] == [("r2", 120), ("r4.5", 270), ("r0.01", 8)]
    # Per-request lists of a --save-detailed result; a refused request has no first token (ttft 0).
    detailed = RESULT | {"ttfts": [1.5, 2.5, 0.0, 1.0], "itls": [[0.1, 0.2], [0.1], [], [0.25, 0.25]]}
    _, details = run_from_vllm_result("v r2", detailed, {"ttft": 2000.0, "tpot": 200.0})
    assert details["served_with_latencies"] == 3
    assert details["over_ttft_objective"] == 1  # 2.5 s
    assert details["over_tpot_objective"] == 1  # the last (250 ms); the first is 150 ms
    assert "over_ttft_objective" not in run_from_vllm_result("v r2", detailed)[1]
