"""Qwen2.5-VL and Qwen3-VL through the real processes (`tpserve launch`), against transformers in
float64: one stack per configuration (Qwen2.5-VL at --tp 2, its KV heads and MLP split; Qwen3-VL at
--tp 1), chunked prefill forced (a token budget of 32 per step) and the prefix cache on. Text-only
prompts decode transformers' greedy tokens, several at once, and the longest again on the prefix cache."""

from __future__ import annotations

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.qwen_vl_checkpoints import build_checkpoint, load_reference
from tests.reference import GREEDY, run_concurrently
from tests.unit.greedy import hf_greedy
from tests.unit.test_qwen_vl_text import text_prompts

NEW_TOKENS = 12
FLAGS = ("--dtype", "float64", "--max-num-batched-tokens", "32", "--enable-prefix-caching")
CONFIGS = [("qwen2_5_vl", 2), ("qwen3_vl", 1)]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{f}-tp{tp}" for f, tp in CONFIGS])
def stack(request, tmp_path_factory):
    """(family, gRPC stub, transformers' float64 model): one stack start per configuration."""
    family, tp = request.param
    model = build_checkpoint(family, tmp_path_factory.mktemp(family))
    reference = load_reference(model)
    with launch(model, *FLAGS, "--tp", str(tp)) as (target, _), grpc.insecure_channel(target) as channel:
        yield family, generation_pb2_grpc.GenerationStub(channel), reference


def _request(ids: list[int]) -> dict:
    return dict(token_ids=list(ids), max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=GREEDY)


def test_text_prompts_serve_transformers_tokens(stack):
    family, stub, reference = stack
    prompts = text_prompts()
    want = hf_greedy(reference, prompts, NEW_TOKENS)
    results = run_concurrently(stub, [_request(ids) for ids in prompts])
    assert [tokens for tokens, *_ in results] == want, family
    # The longest again: its full blocks come from the prefix cache.
    (tokens, *_, last), *_ = run_concurrently(stub, [_request(prompts[-1])])
    assert tokens == want[-1] and last.usage.cached_tokens == 32, family
