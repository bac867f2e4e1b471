"""AWQ and GPTQ checkpoints through the real processes: the tiny model's linear layers quantized to
4 bits (asymmetric min-max, groups of 32: the tiny model's inputs are 64 and 128 wide) and written in each
format's documented packing (quant/awq.py pack_awq, quant/gptq.py pack_gptq, which the unit tests check
against bit-by-bit readers), served; greedy tokens must equal transformers' on the same weights
dequantized (a float checkpoint written alongside, float64 on both sides). AWQ at --tp 2 (column- and
row-parallel shards of packed words and group scales), GPTQ with desc_act (a random act-order g_idx
per layer input, shared by the layers that read the same input, as GPTQ writes it) with preemption
(--num-kv-blocks 16) and chunked prefill (--max-num-batched-tokens 64); other bit widths refused.
"""

from __future__ import annotations

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.quant_checkpoints import write_int4
from tests.reference import assert_matches_reference, hf_greedy

GROUP = 32


def serve_and_compare(model, reference_dir, *flags):
    reference = hf_greedy(reference_dir)
    with launch(model, "--dtype", "float64", *flags) as (target, _), grpc.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        assert_matches_reference(stub, reference)
        return stub.GetStats(pb.StatsRequest())


def test_awq_at_tp2_equals_transformers_on_the_dequantized_weights(tiny_model, tmp_path):
    model, ref = write_int4(tiny_model, tmp_path / "awq", "awq", GROUP, tmp_path / "awq-ref")
    serve_and_compare(model, ref, "--tp", "2")


def test_gptq_desc_act_equals_transformers_under_preemption(tiny_model, tmp_path):
    model, ref = write_int4(
        tiny_model, tmp_path / "gptq", "gptq", GROUP, tmp_path / "gptq-ref", desc_act=True
    )
    stats = serve_and_compare(model, ref, "--num-kv-blocks", "16", "--max-num-batched-tokens", "64")
    assert stats.num_preemptions_total > 0
