"""Grammar state survives what the engine does to sequences, through the real processes (tiny model,
float64): under forced preemption, and when the shard worker and then the scheduler are killed mid-stream
(the worker's sequences are rebuilt from their tokens, the router resumes its requests elsewhere), every
answer under a grammar equals its undisturbed run, token for token, and follows the grammar."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_resume import Tracked, kill_mid_stream, lost_lines, resumed
from tests.reference import generate, run_concurrently

SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 12,
    "maxItems": 16,
}
# 14 KV blocks of 16 tokens: four sequences of 40 + 30 to 64 tokens cannot all stay.
FLAGS = ("--dtype", "float64", "--num-kv-blocks", "14", "--max-num-seqs", "4", "--max-restarts", "4")


def requests() -> list[dict]:
    grammar = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    return [
        dict(
            token_ids=[5 + i] * 40,
            max_new_tokens=64,
            sampling=pb.SamplingParams(
                temperature=0.0 if i % 2 else 1.0, seed=40 + i, structured_output=grammar
            ),
        )
        for i in range(8)
    ]


@pytest.fixture(scope="module")
def stack(tiny_model):
    with launch(tiny_model, *FLAGS) as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            alone = [generate(stub, **r)[0] for r in requests()]  # one at a time: nothing preempted
            assert stub.GetStats(pb.StatsRequest()).num_preemptions_total == 0
            yield stub, info, alone


def test_under_preemption_grammar_outputs_equal_undisturbed_runs(stack, tiny_model):
    from transformers import AutoTokenizer

    stub, _, alone = stack
    together = [r[0] for r in run_concurrently(stub, requests())]
    assert stub.GetStats(pb.StatsRequest()).num_preemptions_total > 0
    assert together == alone
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for tokens in alone:
        if tokens[-1] == 1:  # ended by the grammar (EOS), not by max_new_tokens
            jsonschema.validate(json.loads(tok.decode(tokens[:-1])), SCHEMA)


def test_a_killed_worker_and_scheduler_resume_grammar_state(stack):
    stub, info, alone = stack
    tracked = Tracked(stub, requests())
    kill_mid_stream(info, tracked, ["shard-worker rank 0", "scheduler"]).join()
    disturbed = [r[0] for r in tracked.join()]
    assert tracked.errors == []
    assert resumed(info) >= 1, lost_lines(info)
    assert disturbed == alone


def test_a_grammar_that_does_not_compile_is_invalid_argument_naming_the_field(stack):
    stub, *_ = stack
    bad = pb.SamplingParams(structured_output=pb.StructuredOutput(regex="a(b"))
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, token_ids=[5, 6], max_new_tokens=4, sampling=bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured_output.regex does not compile" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        generate(
            stub, token_ids=[5, 6], max_new_tokens=4, ignore_eos=True, sampling=requests()[0]["sampling"]
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ignore_eos" in e.value.details()
