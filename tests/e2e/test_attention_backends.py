"""Each attention backend that runs on CPU serves the same greedy tokens through the real processes as
transformers gives: flex, the per-sequence reference, and the Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1 in the stack's environment; slow, so the limits and prompts are small)."""

from __future__ import annotations

import random

import grpc
import torch

from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.reference import GREEDY, run_concurrently
from tests.unit.greedy import hf_greedy

NEW_TOKENS = 6
# A prompt inside one block, one across a block boundary, one of several blocks: batched together, then
# decoding side by side (the Triton launch serves prefills and decodes in one step).
PROMPT_LENS = (3, 17, 40)
# The profiling step (the worst the scheduler can form) runs under the interpreter at start-up too.
SMALL_LIMITS = ("--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "96")


def test_every_cpu_backend_serves_transformers_greedy_tokens(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    rng = random.Random(20)
    prompts = [[rng.randrange(2, 1024) for _ in range(n)] for n in PROMPT_LENS]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    want = hf_greedy(model, prompts, NEW_TOKENS)
    requests = [
        dict(token_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=GREEDY) for p in prompts
    ]
    for backend in ("flex", "reference", "triton"):
        if backend == "triton":  # inherited by the stack's processes, read when they import the kernels
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        flags = ("--dtype", "float32", "--attention-backend", backend, *SMALL_LIMITS)
        with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
            results = run_concurrently(generation_pb2_grpc.GenerationStub(channel), requests)
        assert [tokens for tokens, *_ in results] == want, backend
