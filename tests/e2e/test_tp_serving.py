"""Tensor parallelism through the real processes: --tp 2 over gloo gives transformers' greedy tokens."""

from __future__ import annotations

import re

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.reference import assert_matches_reference, hf_greedy


def test_tp2_equals_transformers_under_preemption_and_uses_both_ranks(tiny_model, reference):
    """One stack for both (a start is the cost here): every prompt equals transformers, while 16 KV
    blocks preempt some of them and the rest run undisturbed."""
    flags = ("--tp", "2", "--dtype", "float64", "--num-kv-blocks", "16")
    with launch(tiny_model, *flags) as (target, info):
        assert {"shard-worker rank 0", "shard-worker rank 1"} <= set(info["pids"])
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            assert stub.GetModelInfo(pb.ModelInfoRequest()).tensor_parallel_size == 2
            assert_matches_reference(stub, reference)
            stats = stub.GetStats(pb.StatsRequest())
            assert stats.num_preemptions_total > 0
            # Both ranks took part in every step, so some time went to all-reduce.
            assert stats.num_steps_total > 0 and stats.allreduce_seconds_total > 0


def test_tp2_with_one_kv_head_replicates_it(tmp_path):
    from shard_worker.model.builder import build_model

    model = build_model("tiny", tmp_path / "tiny-1kv", num_kv_heads=1)
    reference = hf_greedy(model)
    flags = ("--tp", "2", "--dtype", "float64")
    with launch(model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        assert_matches_reference(generation_pb2_grpc.GenerationStub(channel), reference)


def test_tp_that_does_not_divide_the_heads_fails_naming_the_numbers(tiny_model):
    # The tiny model has 4 attention heads: 3 ranks cannot split them.
    with pytest.raises(RuntimeError) as e, launch(tiny_model, "--tp", "3", startup_timeout=120):
        pass
    assert "num_attention_heads 4 is not divisible by tensor_parallel_size 3" in str(e.value)
    # The launcher's own last line names the rank that died and what it said.
    assert re.search(
        r"tpserve launch: shard-worker rank \d: num_attention_heads 4 is not divisible", str(e.value)
    )
