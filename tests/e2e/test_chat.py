"""Chat through the real processes on models/smollm2 (SmolLM2-135M-Instruct, a real model with a ChatML
template): greedy answers to conversations sent as gRPC `messages`, all at once, equal transformers'
generate on the same directory with its own apply_chat_template, token for token up to and including
<|im_end|>. Also what gRPC tools rely on: server reflection and google.rpc.BadRequest details."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import ROOT
from tests.reference import run_concurrently

SMOLLM2 = ROOT / "models" / "smollm2"
NEW_TOKENS = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain what a GPU is in one sentence."}],
    [{"role": "user", "content": "Give me three tips for learning to cook."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "What color is the sky?"},
    ],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Name a planet in the solar system."}],
]

pytestmark = pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(),
    reason="models/smollm2 is not built (`make model-smollm2` builds it; `make test` does it first)",
)


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]], int]:
    """transformers' greedy answers (prompt ids, generated ids, EOS id), float32, stopping at EOS as the
    server does. One intra-op thread: with two on a busy 2-core machine generate runs 10-20x slower."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts, answers = [], []
        for chat in CHATS:
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
            prompts.append(list(ids))
            answers.append(out[0, len(ids) :].tolist())
    finally:
        torch.set_num_threads(threads)
    return prompts, answers, tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    with grpc.insecure_channel(smollm2_stack[0]) as channel:
        yield channel


def test_concurrent_chats_equal_transformers_token_for_token(stack, reference):
    prompts, answers, eos = reference
    stub = generation_pb2_grpc.GenerationStub(stack)
    requests = [
        dict(
            messages=[pb.ChatMessage(**m) for m in chat],
            max_new_tokens=NEW_TOKENS,
            sampling=pb.SamplingParams(temperature=0.0),
        )
        for chat in CHATS
    ]
    results = run_concurrently(stub, requests)
    stopped = 0
    for chat, prompt, want, (tokens, text, reason, last) in zip(
        CHATS, prompts, answers, results, strict=True
    ):
        question = chat[-1]["content"]
        assert last.usage.prompt_tokens == len(prompt), f"{question!r}: the template rendered differently"
        assert tokens == want, f"{question!r}: {text!r}"
        assert "<|im_end|>" not in text
        if tokens[-1] == eos:
            stopped += 1
            assert reason == pb.FINISH_REASON_EOS, question
        else:
            assert reason == pb.FINISH_REASON_LENGTH and len(tokens) == NEW_TOKENS, question
    assert stopped >= 1  # the EOS path was exercised ("The capital of France is Paris." ends well within 32)
    assert "Paris" in results[0][1]


def test_float32_logprobs_equal_transformers_float32_within_1e_4(stack, reference, one_thread):
    """--dtype float32 is float32 in every layer (no bf16 linear layers on a CPU with native bf16): the
    chosen token's logprob along each greedy path within 1e-4 of transformers' float32, teacher forced.
    Served concurrently, so the rows share batched steps; transformers on one thread (conftest)."""
    from transformers import AutoModelForCausalLM

    prompts = reference[0][:4]
    stub = generation_pb2_grpc.GenerationStub(stack)

    def served(ids):
        request = pb.GenerateRequest(
            token_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True, top_logprobs=1
        )
        request.sampling.temperature = 0.0
        tokens, logprobs = [], []
        for resp in stub.Generate(request, timeout=120):
            tokens += resp.token_ids
            logprobs += [lp.chosen.logprob for lp in resp.logprobs]
        return tokens, logprobs

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(served, prompts))
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    worst = 0.0
    for ids, (tokens, logprobs) in zip(prompts, results, strict=True):
        assert len(tokens) == len(logprobs) == NEW_TOKENS
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(logprobs) - want).abs().max().item())
    assert worst < 1e-4, worst


def test_reflection_lists_the_generation_service(stack):
    services = ProtoReflectionDescriptorDatabase(stack).get_services()
    assert "tpserve.v1.Generation" in services and "grpc.health.v1.Health" in services


def test_invalid_argument_carries_a_bad_request_detail_naming_the_field(stack):
    stub = generation_pb2_grpc.GenerationStub(stack)
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="robot", content="hi")], max_new_tokens=4)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(e.value)
    assert status is not None and len(status.details) == 1
    detail = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(detail)
    (violation,) = detail.field_violations
    assert violation.field == "messages[0].role" and "robot" in violation.description
