"""Each attention backend that runs on CPU serves the same greedy tokens through the real processes as
transformers gives: our C++ kernel (cpu), flex, the per-sequence reference, and the Triton kernels under
Triton's interpreter (TRITON_INTERPRET=1 in the stack's environment; slow, so one prompt under small
limits); with bf16 linear weights, the tokens and logprobs of transformers with bf16 products; and a
bfloat16 model on the cpu kernel, within transformers' bfloat16 top 3."""

from __future__ import annotations

import random

import grpc
import torch

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.reference import GREEDY, run_concurrently
from tests.unit.greedy import bf16_products, hf_greedy

NEW_TOKENS = 6
# A prompt inside one block, one across a block boundary, one of several blocks: batched together, then
# decoding side by side (the Triton launch serves prefills and decodes in one step).
PROMPT_LENS = (3, 17, 40)
# The profiling step (the worst the scheduler can form) runs under the interpreter at start-up too.
SMALL_LIMITS = ("--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "96")
# The Triton stack runs every step under the interpreter, its profiling step included: one prompt across
# a block boundary (prefill, then decodes) under limits of one sequence of 32 tokens. Its kernels on mixed
# prefill/decode steps, split KV and sinks are tests/unit/test_triton_backend.py's, under the interpreter.
TRITON_PROMPTS = 1  # the prompt of 17 tokens
TRITON_LIMITS = ("--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--max-model-len", "32")


def test_every_cpu_backend_serves_transformers_greedy_tokens(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    rng = random.Random(20)
    prompts = [[rng.randrange(2, 1024) for _ in range(n)] for n in PROMPT_LENS]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    want = hf_greedy(model, prompts, NEW_TOKENS)
    requests = [
        dict(token_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=GREEDY) for p in prompts
    ]
    for backend in ("cpu", "flex", "reference", "triton"):
        limits, chosen = SMALL_LIMITS, slice(None)
        if backend == "triton":  # inherited by the stack's processes, read when they import the kernels
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            limits, chosen = TRITON_LIMITS, slice(TRITON_PROMPTS, TRITON_PROMPTS + 1)
        flags = ("--dtype", "float32", "--attention-backend", backend)
        with (
            launch(tiny_model, *flags, *limits) as (target, _),
            grpc.insecure_channel(target) as channel,
        ):
            results = run_concurrently(generation_pb2_grpc.GenerationStub(channel), requests[chosen])
        assert [tokens for tokens, *_ in results] == want[chosen], backend


def _chosen_logprobs(stub, request: dict) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    for resp in stub.Generate(pb.GenerateRequest(**request, top_logprobs=1), timeout=120):
        tokens += resp.token_ids
        logprobs += [lp.chosen.logprob for lp in resp.logprobs]
    return tokens, logprobs


def _reference_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_bf16_linear_weights_serve_what_transformers_computes_with_bf16_products(tiny_model):
    from transformers import AutoModelForCausalLM

    rng = random.Random(21)
    prompts = [[rng.randrange(2, 1024) for _ in range(n)] for n in PROMPT_LENS]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    flags = ("--dtype", "float32", "--linear-dtype", "bfloat16", *SMALL_LIMITS)
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        got = [
            _chosen_logprobs(
                stub, dict(token_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=GREEDY)
            )
            for p in prompts
        ]
    exact = [_reference_logprobs(model, p, tokens) for p, (tokens, _) in zip(prompts, got, strict=True)]
    bf16_products(model)
    assert [tokens for tokens, _ in got] == hf_greedy(model, prompts, NEW_TOKENS)
    for p, (tokens, logprobs) in zip(prompts, got, strict=True):
        torch.testing.assert_close(logprobs, _reference_logprobs(model, p, tokens), rtol=0, atol=1e-4)
    # ... and not float32's: products left in float32 would fail here.
    differences = [
        abs(a - b) for (_, lps), f32 in zip(got, exact, strict=True) for a, b in zip(lps, f32, strict=True)
    ]
    assert max(differences) > 1e-3


def test_a_bfloat16_model_on_the_cpu_kernel_serves_transformers_bfloat16_tokens(tiny_model):
    """--dtype bfloat16 end to end (weights, activations, KV cache) on the cpu backend, prompts batched
    with decodes and a prefill past the kernel's query threshold: every greedy token is among transformers'
    bfloat16 model's top 3 at its position (teacher forced on our tokens). Not equality: the kernel
    accumulates in float32 where transformers' bf16 attention rounds differently, and a random model's
    close logits can swap."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(22)
    prompts = [[rng.randrange(2, 1024) for _ in range(n)] for n in PROMPT_LENS]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    flags = ("--dtype", "bfloat16", "--attention-backend", "cpu", *SMALL_LIMITS)
    requests = [
        dict(token_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=GREEDY) for p in prompts
    ]
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        results = run_concurrently(generation_pb2_grpc.GenerationStub(channel), requests)
    for p, (tokens, *_) in zip(prompts, results, strict=True):
        assert len(tokens) == NEW_TOKENS
        with torch.no_grad():
            logits = model(torch.tensor([p + tokens])).logits[0, len(p) - 1 : -1]
        top = logits.topk(3, dim=-1).indices.tolist()
        assert all(t in top[i] for i, t in enumerate(tokens)), (tokens, top)


def test_dtype_auto_is_resolved_by_the_worker_for_this_machine(tiny_model):
    """--dtype auto through the real processes: the worker picks what devices.model_dtype gives for this
    CPU (bfloat16 with native bf16 products, else float32), says so with the reason, and serves with it."""
    from shard_worker import devices

    want, why = devices.model_dtype("auto", "cpu", devices.cpu_flags(), False)
    request = dict(token_ids=[5, 6, 7], max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=GREEDY)
    with (
        launch(tiny_model, "--dtype", "auto", *SMALL_LIMITS, log_level="INFO") as (target, info),
        grpc.insecure_channel(target) as channel,
    ):
        ((tokens, *_),) = run_concurrently(generation_pb2_grpc.GenerationStub(channel), [request])
        log = info["log"].read_text()
    assert len(tokens) == NEW_TOKENS
    assert f"rank 0: --dtype auto is {want}: {why}" in log
