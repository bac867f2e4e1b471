"""--load-format dummy: a model served from its config.json alone (no weights, no tokenizer on disk), as a
benchmark at real shapes needs."""

from __future__ import annotations

import shutil

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch


def test_a_config_only_model_serves_token_ids(tiny_model, tmp_path):
    shutil.copy(tiny_model / "config.json", tmp_path / "config.json")
    with launch(tmp_path, "--load-format", "dummy") as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(pb.ModelInfoRequest())
        assert info.vocab_size == 1024
        responses = list(
            stub.Generate(pb.GenerateRequest(token_ids=[5] * 20, max_new_tokens=8, ignore_eos=True))
        )
        tokens = [t for r in responses for t in r.token_ids]
        assert len(tokens) == 8 and all(0 <= t < info.vocab_size for t in tokens)
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="no tokenizer here", max_new_tokens=2)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.details()
