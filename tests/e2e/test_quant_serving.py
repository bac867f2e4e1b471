"""Quantized models through the real processes (`tpserve launch`), against transformers' generate in
float64 on the same weights dequantized: several prompts at once, chunked prefill (64 tokens a step) and
preemption (16 KV blocks) forced, one stack per configuration: a 4-bit (asymmetric, group 128) and an
8-bit compressed-tensors checkpoint at --tp 2 (group scales and zero points split with the input
features), and --quantization int8 against the same model quantized offline. W8A8 is not served at --tp 2
here: a row-parallel layer rounds its activations per token over its rank's share of the features (as
vLLM does), which transformers' single-device reference does not. The other schemes are
tests/unit/test_quant_formats.py's, on the ModelRunner. And a refused format: one line, exit 2."""

from __future__ import annotations

import json

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_startup_errors import only_line, tpserve
from tests.quant_checkpoints import (
    activation_rounding,
    build_compressed,
    build_unquantized,
    dequantized_copy,
    offline_quantized,
)
from tests.reference import MAX_NEW as DEFAULT_MAX_NEW
from tests.reference import PROMPT_LENS, assert_matches_reference, hf_greedy

FLAGS = ("--dtype", "float64", "--max-num-batched-tokens", "64", "--num-kv-blocks", "16")
# Every prompt of tests/reference.py (1 to 200 tokens) for MAX_NEW tokens: together far past 16 blocks of
# 16, so decodes outgrow the pool and preemption is forced whatever order the requests arrive in (four
# prompts for 12 tokens were not enough: the two long ones, admitted one after the other, never met).
LENS, MAX_NEW = PROMPT_LENS, DEFAULT_MAX_NEW


def serve_and_compare(model, reference, *flags: str) -> None:
    with launch(model, *FLAGS, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert_matches_reference(stub, reference)
        stats = stub.GetStats(pb.StatsRequest())
        assert stats.num_preemptions_total > 0
        assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("scheme", ["w4a16_asym", "w8a16"])
def test_compressed_tensors_at_tp2_serves_transformers_tokens(tmp_path, scheme):
    model = build_compressed(scheme, tmp_path / scheme)
    dequantized = dequantized_copy(model, tmp_path / "dequantized")
    reference = hf_greedy(dequantized, activation_rounding(model), LENS, MAX_NEW)
    serve_and_compare(model, reference, "--tp", "2")


def test_online_int8_serves_the_offline_quantized_model_tokens(tmp_path):
    model = build_unquantized(tmp_path / "model")
    reference = hf_greedy(offline_quantized(model, tmp_path / "offline", "int8"), None, LENS, MAX_NEW)
    serve_and_compare(model, reference, "--quantization", "int8")


def test_worker_refuses_an_unsupported_format_in_one_line(tmp_path):
    model = build_unquantized(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (model / "config.json").write_text(json.dumps(config))
    line = only_line(tpserve("shard-worker", "--model", str(model)), "shard-worker")
    assert "quant_method 'bitsandbytes' is not supported" in line and str(model / "config.json") in line
