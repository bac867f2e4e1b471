"""Logits processors through the real processes, on gRPC and on the OpenAI HTTP API: logit_bias of +100
makes greedy decoding output that token and -100 bans it; min_tokens holds back EOS and stop_token_ids
until reached; and the rest of a batch gets exactly what it gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.reference import generate

PROMPT = [5, 17, 33, 2, 48, 9]
NEW = 8


@pytest.fixture(scope="module")
def stack(tiny_model):
    with launch(tiny_model, "--dtype", "float64", "--http-port", "0") as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            http = openai.OpenAI(
                base_url=f"http://127.0.0.1:{info['http_port']}/v1", api_key="x", max_retries=0, timeout=120
            )
            model = http.models.list().data[0].id
            yield stub, http, model, stub.GetModelInfo(pb.ModelInfoRequest())


def grpc_tokens(stub, **sampling) -> tuple[list[int], int]:
    kw = {k: sampling.pop(k) for k in ("stop_token_ids", "ignore_eos") if k in sampling}
    tokens, _, reason, _ = generate(
        stub,
        token_ids=PROMPT,
        max_new_tokens=NEW,
        sampling=pb.SamplingParams(temperature=0.0, **sampling),
        **kw,
    )
    return tokens, reason


def test_logit_bias_forces_and_bans_a_token_on_grpc(stack):
    stub, *_ = stack
    plain, _ = grpc_tokens(stub, ignore_eos=True)
    forced = next(t for t in range(40, 400) if t not in plain)
    tokens, _ = grpc_tokens(stub, ignore_eos=True, logit_bias={forced: 100.0})
    assert tokens == [forced] * NEW
    banned, _ = grpc_tokens(stub, ignore_eos=True, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0] and plain[0] not in banned


def test_min_tokens_holds_back_stop_ids_and_eos_on_grpc(stack):
    stub, _, _, info = stack
    plain, _ = grpc_tokens(stub, ignore_eos=True)
    # Without min_tokens the third token is a stop id and ends the request there.
    stopped, reason = grpc_tokens(stub, stop_token_ids=[plain[2]], ignore_eos=True)
    assert stopped == plain[:3] and reason == pb.FINISH_REASON_EOS
    held, _ = grpc_tokens(stub, stop_token_ids=[plain[2]], ignore_eos=True, min_tokens=5)
    assert len(held) >= 5 and plain[2] not in held[:4]
    # EOS forced by a bias comes only once min_tokens tokens are out.
    eos = info.eos_token_ids[0]
    tokens, reason = grpc_tokens(stub, logit_bias={eos: 100.0}, min_tokens=4)
    assert len(tokens) == 5 and tokens[-1] == eos and eos not in tokens[:4]
    assert reason == pb.FINISH_REASON_EOS


def test_the_rest_of_a_batch_is_untouched(stack):
    """Requests with processors beside plain ones: each gets what it gets alone."""
    stub, *_ = stack
    plain, _ = grpc_tokens(stub, ignore_eos=True)
    forced = next(t for t in range(40, 400) if t not in plain)
    kinds = [
        {"ignore_eos": True},
        {"ignore_eos": True, "logit_bias": {forced: 100.0}},
        {"ignore_eos": True, "logit_bias": {plain[0]: -100.0}},
        {"ignore_eos": True, "stop_token_ids": [plain[2]], "min_tokens": 5},
        {"ignore_eos": True, "bad_words_token_ids": [pb.TokenIds(ids=[plain[1]])]},
        {"ignore_eos": True, "frequency_penalty": 1.5},
    ]
    alone = [grpc_tokens(stub, **dict(k)) for k in kinds]
    with ThreadPoolExecutor(len(kinds) * 2) as pool:
        together = list(pool.map(lambda k: grpc_tokens(stub, **dict(k)), kinds * 2))
    assert together == alone * 2
    assert plain[1] not in alone[4][0]  # the bad word never comes


def test_logit_bias_and_min_tokens_on_the_openai_api(stack):
    stub, http, model, info = stack
    plain, _ = grpc_tokens(stub, ignore_eos=True)
    forced = next(t for t in range(40, 400) if t not in plain)
    out = http.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW, temperature=0, logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    want, _, _, _ = generate(
        stub,
        token_ids=PROMPT,
        max_new_tokens=NEW,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0, logit_bias={forced: 100.0}),
    )
    assert want == [forced] * NEW
    assert out.usage.completion_tokens == NEW
    _, text, _, _ = generate(
        stub,
        token_ids=PROMPT,
        max_new_tokens=NEW,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0, logit_bias={forced: 100.0}),
    )
    assert out.choices[0].text == text
    eos = info.eos_token_ids[0]
    out = http.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW, temperature=0, logit_bias={str(eos): 100},
        extra_body={"min_tokens": 4},
    )  # fmt: skip
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "stop"
