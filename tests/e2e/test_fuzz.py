"""Seeded property-based fuzzing of the public API: any request gets a result or INVALID_ARGUMENT,
never INTERNAL; what comes back is sane (token ids in the vocabulary, a vanishing temperature decodes
as greedy does, no stream stuck on the last vocabulary id as garbage logits used to give); and the
server stays healthy with every block free."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch

UINT32 = st.integers(0, 2**32 - 1)
# Valid unicode only: protobuf strings must be UTF-8, so a lone surrogate never leaves the client.
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=120)
# No subnormals from hypothesis itself: an in-process torch test may have set flush-to-zero, which makes
# hypothesis refuse them; 1e-45 below still sends one to the server.
ANY_FLOAT = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=False)
# Short generations when valid, absurd ones otherwise: the fuzz is about input, not long runs.
MAX_NEW = st.one_of(st.integers(0, 6), st.integers(2**20, 2**32 - 1))


@st.composite
def sampling(draw):
    fields = {}
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if draw(st.booleans()):
            fields[name] = draw(st.one_of(ANY_FLOAT, st.sampled_from([0.0, 1e-45, 1e-30, 1.0, 1e30])))
    if draw(st.booleans()):
        fields["top_k"] = draw(st.integers(-(2**31), 2**31 - 1))
    if draw(st.booleans()):
        fields["seed"] = draw(st.integers(0, 2**64 - 1))
    return pb.SamplingParams(**fields)


@st.composite
def requests(draw):
    kw = {"max_new_tokens": draw(MAX_NEW), "sampling": draw(sampling())}
    prompt = draw(st.sampled_from(["text", "ids", "both", "neither"]))
    if prompt in ("text", "both"):
        kw["text"] = draw(TEXT)
    if prompt in ("ids", "both"):
        kw["token_ids"] = draw(st.lists(st.one_of(st.integers(0, 1100), UINT32), max_size=40))
    kw["request_id"] = draw(st.one_of(st.just(""), TEXT))
    kw["stop"] = draw(st.lists(TEXT, max_size=20))
    kw["stop_token_ids"] = draw(st.lists(UINT32, max_size=5))
    kw["ignore_eos"] = draw(st.booleans())
    kw["top_logprobs"] = draw(st.one_of(st.integers(0, 25), UINT32))
    return pb.GenerateRequest(**kw)


VOCAB = 1024  # the tiny model's
GREEDY_BELOW = 1e-5  # router/sampling_checks.py: a smaller temperature is greedy decoding


@pytest.fixture(scope="module")
def stack(tiny_model):
    with launch(tiny_model) as (target, _), grpc.insecure_channel(target) as channel:
        yield target, generation_pb2_grpc.GenerationStub(channel)


def tokens_of(stub, request) -> list[int]:
    return [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]


@settings(
    max_examples=150,
    derandomize=True,  # seeded: the same requests every run
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_any_request_gets_a_result_or_invalid_argument(stack, request):
    _, stub = stack
    try:
        responses = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), request)
        return
    last = responses[-1]
    assert last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == last.usage.completion_tokens <= request.max_new_tokens
    assert all(0 <= t < VOCAB for t in tokens), tokens
    assert not (len(tokens) >= 3 and set(tokens) == {VOCAB - 1}), ("stuck on the last id", request)
    temperature = request.sampling.temperature
    if request.sampling.HasField("temperature") and 0 < temperature < GREEDY_BELOW:
        greedy = pb.GenerateRequest()
        greedy.CopyFrom(request)
        greedy.request_id = ""
        greedy.sampling.temperature = 0.0
        assert tokens_of(stub, greedy) == tokens, ("a vanishing temperature is not greedy", request)


def test_server_is_healthy_with_every_block_free_after_the_fuzz(stack):
    target, stub = stack
    with grpc.insecure_channel(target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    stats = stub.GetStats(pb.StatsRequest())
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0
