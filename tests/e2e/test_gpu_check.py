"""The GPU check script (bench/gpu_check.py) at toy sizes on CPU: what a device lease runs is run here
(its Triton parts under the interpreter)."""

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
    # The Triton backend against the reference in each dtype, the split path included (interpreted).
    attention = doc["attention"]
    assert attention["ok"] and {c["dtype"] for c in attention["cases"]} == {"float16", "bfloat16", "float32"}
    assert any(c["kv_splits"] != [1] for c in attention["cases"])
    # Every bucket's padded replay gives the eager step's tokens.
    graphs = doc["graphs"]
    assert graphs["ok"] and [b["bucket"] for b in graphs["buckets"]] == graphs["sizes"] == [1, 2, 4]
    (timing,) = doc["decode_timing"]["cases"]
    assert all(isinstance(timing[f"{name}_ms"], float) for name in ("triton", "reference", "flex"))
    ref = doc["reference"]["graphs"]
    # float32 on CPU: every greedy token is transformers' (vLLM's looser rule is for bf16 on a GPU).
    assert ref["equal"] == ref["close"] == doc["reference"]["prompts"] == 8
    assert "eager" not in doc["reference"]  # on CPU the --enforce-eager runs would repeat these
    bench = doc["benchmark"]["graphs"]
    for workload in ("continuous", "static", "decode"):
        part = bench[workload]
        assert part["ok"] == 8 and part["failed"] == 0, part
        assert part["ttft_ms"]["p50"] > 0 and part["tpot_ms"]["p50"] > 0
        assert part["device_memory_gib"]["shard-worker rank 0"] > 0
    assert bench["continuous_over_static"] > 0
    assert doc["tpot_p99_batch64"]["graphs"]["p99_ms"] == bench["decode"]["tpot_ms"]["p99"]
    # The quantized products: the Triton kernels (interpreted) and fp8's _scaled_mm call (torch's CPU
    # build) against the dequantized weight's product, timed; then --quantization int8 served against
    # transformers on the same model quantized and dequantized offline; then a quantized stack's decode.
    quant = doc["quant"]
    assert quant["ok"], quant["errors"]
    assert quant["kernels"]["int4"] == "triton int4" and quant["kernels"]["int8"] == "triton int8"
    assert quant["kernels"]["fp8"].startswith("scaled_mm")
    for batch in ("batch 1", "batch 8"):
        assert all(quant["timing"][batch][fmt]["eager_ms"] > 0 for fmt in ("dense", "int4", "int8", "fp8"))
    served = doc["quant_reference"]
    # Exact against the dequantized model with its projections' inputs rounded to bf16, as the CPU int8
    # kernel rounds them. quick: one stack.
    assert served["int8"]["equal"] == served["prompts"] and "fp8" not in served, served
    stack = doc["quant_stack"]["int4"]  # quick: the int4 stack only (every format's config: unit-tested)
    assert stack["batch 1"]["ok"] == 1 and stack["batch 4"]["ok"] == 4, stack
    assert stack["batch 4"]["output_tokens_per_s"] > 0
