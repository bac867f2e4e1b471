"""The serving path through the real processes and gRPC, against transformers as the reference."""

from __future__ import annotations

import random
import subprocess
import sys

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import ROOT, launch
from tests.reference import GREEDY, MAX_NEW, assert_matches_reference, generate, run_concurrently


@pytest.fixture(scope="module")
def target(tiny_model):
    with launch(tiny_model, "--dtype", "float64") as (target, _):
        yield target


@pytest.fixture(scope="module")
def server(target):
    with grpc.insecure_channel(target) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def test_greedy_outputs_equal_transformers(server, reference):
    assert_matches_reference(server, reference)
    stats = server.GetStats(pb.StatsRequest())
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0


def test_model_info(server, tiny_model):
    info = server.GetModelInfo(pb.ModelInfoRequest())
    assert info.vocab_size == 1024 and info.block_size == 16 and info.tensor_parallel_size == 1
    assert info.max_model_len == 1024 and list(info.eos_token_ids) == [1]


def test_text_prompt_streams_text_matching_tokens(server, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    chunks = list(
        server.Generate(
            pb.GenerateRequest(text="Hello there, héllo 日本", max_new_tokens=20, ignore_eos=True)
        )
    )
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 20 and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert "".join(c.text for c in chunks) == tok.decode(tokens, skip_special_tokens=True)
    assert chunks[-1].usage.prompt_tokens == len(tok("Hello there, héllo 日本")["input_ids"])


def test_stop_token_id_ends_generation_with_the_token(server, reference):
    # A token the reference produces mid-way is made a stop token: generation ends right after it.
    ids, cont = next(iter(reference.items()))
    stop_at = cont[5]
    tokens, _, reason, _ = generate(
        server, token_ids=list(ids), max_new_tokens=MAX_NEW, stop_token_ids=[stop_at], sampling=GREEDY
    )
    assert reason == pb.FINISH_REASON_EOS and tokens == cont[: cont.index(stop_at) + 1]


def test_stop_string_is_not_returned(server):
    tokens, text, reason, _ = generate(
        server, text="abc", max_new_tokens=30, ignore_eos=True, sampling=GREEDY
    )
    assert reason == pb.FINISH_REASON_LENGTH and len(text) > 4
    stop = text[2:5]
    _, stopped_text, reason, last = generate(
        server, text="abc", max_new_tokens=30, ignore_eos=True, stop=[stop], sampling=GREEDY
    )
    assert reason == pb.FINISH_REASON_STOP
    assert stopped_text == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(server):
    seeded = dict(
        text="Once upon a time",
        max_new_tokens=20,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=1.0, top_p=0.9, seed=42),
    )
    alone, _, _, _ = generate(server, **seeded)
    noise = [
        dict(text="x" * n, max_new_tokens=20, ignore_eos=True, sampling=pb.SamplingParams(temperature=1.5))
        for n in (3, 30, 60)
    ]
    crowded = run_concurrently(server, [*noise, seeded, *noise])[len(noise)][0]
    assert alone == crowded
    other_seed, _, _, _ = generate(
        server, **{**seeded, "sampling": pb.SamplingParams(temperature=1.0, seed=7)}
    )
    assert other_seed != alone


def test_logprobs_are_returned_when_asked(server):
    chunks = list(
        server.Generate(
            pb.GenerateRequest(text="hi", max_new_tokens=3, ignore_eos=True, top_logprobs=4, sampling=GREEDY)
        )
    )
    lps = [lp for c in chunks for lp in c.logprobs]
    assert len(lps) == 3
    for c in chunks:
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert lp.chosen.token_id == tok and len(lp.top) == 4
            # Greedy: the chosen token is the most likely one.
            assert lp.top[0].token_id == tok and lp.chosen.logprob == pytest.approx(lp.top[0].logprob)
            assert all(a.logprob >= b.logprob for a, b in zip(lp.top, lp.top[1:], strict=False))


BAD_REQUESTS = [
    ("empty text", dict(text="", max_new_tokens=4), "text"),
    ("both prompts", dict(text="a", token_ids=[5], max_new_tokens=4), "token_ids"),
    ("token outside vocab", dict(token_ids=[5, 1024], max_new_tokens=4), "token_ids"),
    ("zero max_new_tokens", dict(text="a", max_new_tokens=0), "max_new_tokens"),
    ("too long", dict(token_ids=[5] * 1000, max_new_tokens=100), "max_new_tokens"),
    (
        "negative temperature",
        dict(text="a", max_new_tokens=4, sampling=pb.SamplingParams(temperature=-1)),
        "temperature",
    ),
    ("top_p zero", dict(text="a", max_new_tokens=4, sampling=pb.SamplingParams(top_p=0)), "top_p"),
    ("top_p above one", dict(text="a", max_new_tokens=4, sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    ("negative top_k", dict(text="a", max_new_tokens=4, sampling=pb.SamplingParams(top_k=-1)), "top_k"),
    ("min_p above one", dict(text="a", max_new_tokens=4, sampling=pb.SamplingParams(min_p=1.5)), "min_p"),
    (
        "zero repetition_penalty",
        dict(text="a", max_new_tokens=4, sampling=pb.SamplingParams(repetition_penalty=0)),
        "repetition_penalty",
    ),
    ("17 stop strings", dict(text="a", max_new_tokens=4, stop=[f"s{i}" for i in range(17)]), "stop"),
    ("21 top_logprobs", dict(text="a", max_new_tokens=4, top_logprobs=21), "top_logprobs"),
]


@pytest.mark.parametrize("name,kw,field", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_invalid_argument_and_server_stays_up(server, name, kw, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(server, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    tokens, _, _, _ = generate(server, text="still here", max_new_tokens=2, ignore_eos=True)
    assert len(tokens) == 2


def test_request_id_in_flight_gets_already_exists(server):
    stream = server.Generate(
        pb.GenerateRequest(request_id="dup", text="a", max_new_tokens=200, ignore_eos=True)
    )
    first = next(stream)
    assert first.request_id == "dup"
    with pytest.raises(grpc.RpcError) as e:
        generate(server, request_id="dup", text="b", max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()


def test_32_concurrent_mixed_requests_complete(server):
    rng = random.Random(7)
    reqs = [
        dict(
            token_ids=[rng.randrange(2, 1024) for _ in range(rng.randrange(1, 300))],
            max_new_tokens=rng.randrange(1, 40),
            ignore_eos=True,
        )
        for _ in range(32)
    ]
    for kw, (tokens, _, reason, last) in zip(reqs, run_concurrently(server, reqs), strict=True):
        assert len(tokens) == kw["max_new_tokens"] and reason == pb.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == kw["max_new_tokens"]
    stats = server.GetStats(pb.StatsRequest())
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_outputs_equal_transformers_under_preemption(tiny_model, reference):
    # 16 blocks hold 256 tokens. A long request holds 7 of them when the ten prompts are sent and grows
    # to 14 while they run, so sequences are preempted whatever the arrivals' timing (the ten alone, sent
    # from a busy test process, once reached the scheduler about two at a time: no preemption).
    flags = ("--dtype", "float64", "--num-kv-blocks", "16")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        long = dict(token_ids=[5] * 100, max_new_tokens=120, ignore_eos=True, sampling=GREEDY)
        holder = stub.Generate(pb.GenerateRequest(**long), timeout=120)
        first = next(holder)  # it runs
        assert_matches_reference(stub, reference)
        assert len(first.token_ids) + sum(len(r.token_ids) for r in holder) == 120
        stats = stub.GetStats(pb.StatsRequest())
        assert stats.num_preemptions_total > 0
        assert stats.kv_blocks_free == stats.kv_blocks_total == 16


def test_outputs_equal_transformers_with_chunked_prefill(tiny_model, reference):
    flags = ("--dtype", "float64", "--max-num-batched-tokens", "32")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        assert_matches_reference(generation_pb2_grpc.GenerationStub(channel), reference)


def test_cli_generate_streams_text(target):
    out = subprocess.run(
        [sys.executable, "-m", "common.cli", "generate", "--target", target, "Hello", "--max-new-tokens", "8"]
        + ["--ignore-eos"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) > 0


def test_prefix_caching_reports_cached_tokens_and_keeps_outputs(tiny_model, reference):
    shared = list(next(iter(k for k in reference if len(k) == 200)))
    flags = ("--dtype", "float64", "--enable-prefix-caching")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert_matches_reference(stub, reference)
        # The 200-token prompt again: its 12 full blocks (192 tokens) come from the cache.
        tokens, _, _, last = generate(
            stub, token_ids=shared, max_new_tokens=MAX_NEW, ignore_eos=True, sampling=GREEDY
        )
        assert tokens == reference[tuple(shared)]
        assert last.usage.cached_tokens == 192


def test_outputs_equal_transformers_with_every_policy_on(tiny_model, reference):
    flags = ("--dtype", "float64", "--enable-prefix-caching", "--batch-wait-timeout-ms", "20")
    flags += ("--min-batch-size", "4", "--fallback-static", "--admission-window", "3")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert_matches_reference(stub, reference)
        stats = stub.GetStats(pb.StatsRequest())
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_waiting == 0
