"""The independent reference (transformers) and helpers to compare a running server against it."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import torch

from common.pb.tpserve.v1 import generation_pb2 as pb

MAX_NEW = 24
GREEDY = pb.SamplingParams(temperature=0.0)
PROMPT_LENS = [1, 3, 7, 15, 16, 17, 40, 90, 130, 200]


def prompts(vocab_size: int, lens=PROMPT_LENS) -> list[list[int]]:
    """The prompts of PROMPT_LENS, or those of them whose lengths are in lens (the same tokens)."""
    rng = random.Random(1234)
    every = [[rng.randrange(2, vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    return [p for p in every if len(p) in lens]


def hf_greedy(model_dir, prepare=None, lens=PROMPT_LENS, max_new=MAX_NEW) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuations from transformers' own generate, in float64, EOS ignored. prepare(model):
    anything to do to the model first (a quantized format's activation rounding, as hooks); lens: the
    PROMPT_LENS prompts to take; max_new tokens each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    if prepare is not None:
        prepare(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = {}
    for ids in prompts(model.config.vocab_size, lens):
        gen = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new
        )
        out[tuple(ids)] = gen[0, len(ids) :].tolist()
    return out


def generate(stub, **kw) -> tuple[list[int], str, int, pb.GenerateResponse]:
    """Runs one request to the end; returns (tokens, text, finish_reason, last message)."""
    tokens, text, last = [], "", None
    for resp in stub.Generate(pb.GenerateRequest(**kw), timeout=120):
        tokens += resp.token_ids
        text += resp.text
        last = resp
    return tokens, text, last.finish_reason, last


def run_concurrently(stub, requests: list[dict]) -> list:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda kw: generate(stub, **kw), requests))


def assert_matches_reference(stub, reference):
    """Every prompt of reference at once, each for as many tokens as its reference continuation."""
    reqs = [
        dict(token_ids=ids, max_new_tokens=len(want), ignore_eos=True, sampling=GREEDY)
        for ids, want in reference.items()
    ]
    results = run_concurrently(stub, reqs)
    for ids, (tokens, _, reason, last) in zip(reference, results, strict=True):
        assert tokens == reference[ids], f"prompt of {len(ids)} tokens"
        assert reason == pb.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == len(reference[ids])
