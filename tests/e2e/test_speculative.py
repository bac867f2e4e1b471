"""Speculative decoding through the real processes (`tpserve launch`), one stack per proposer: n-gram
prompt lookup, and a draft model (with --tp 2 and swap space, so the draft's sharded forward, the
proposals rank 0 broadcasts and the draft's swapped cache are on the path too).

Greedy outputs equal transformers' (no speculation there), and seeded ones equal tpserve's own sampler
run without speculation, token for token, for concurrent requests of mixed lengths with chunked prefill
and preemption; a stop token or a stop string inside an accepted run ends the request there; every KV
block is free at the end, and the metrics count what the verifications did.

The target is the tiny model with its second layer damped (its output projections scaled by DAMPING),
and the draft is its first layer alone: they agree part of the time, so verifications accept all, some
and none of their proposals."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from common.sampling import SamplingConfig
from shard_worker.model.draft_builder import build_draft
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit
from tests.conftest import launch
from tests.e2e.test_observability import scrape
from tests.reference import GREEDY, MAX_NEW, generate, hf_greedy, run_concurrently
from tests.unit.test_model_runner import BLOCK_SIZE, BlockPool, Driver, Seq, run_step

DAMPING = 0.3
# Few blocks for ten prompts of up to 200 tokens (preemption), a small budget (chunked prefill), and
# speculation whatever the batch size.
COMMON = ("--dtype", "float64", "--num-kv-blocks", "16", "--max-num-batched-tokens", "48")
COMMON += ("--speculative-disable-by-batch-size", "0", "--num-speculative-tokens", "3", "--metrics-port", "0")
# A KV block of the damped target and its draft on one of two ranks, in float64: 3 layers x K and V x
# 16 tokens x 1 head x 16 dims x 8 bytes. Swap space for 24 of them.
BLOCK_BYTES = 3 * 2 * 16 * 16 * 8
SWAP_GIB = repr(24.5 * BLOCK_BYTES / 2**30)
SEEDED = [SamplingConfig(temperature=1.0, top_p=0.9, seed=100 + i) for i in range(6)]
REFERENCE_BLOCKS = 601  # prime, so BlockPool's scrambled order is a permutation


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    target = tmp_path_factory.mktemp("damped")
    tensors = load_file(tiny_model / "model.safetensors")
    for name in tensors:
        if name.startswith("model.layers.1.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * DAMPING
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    for f in tiny_model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, target / f.name)
    return target, build_draft(target, tmp_path_factory.mktemp("draft"), num_layers=1)


@pytest.fixture(scope="module")
def greedy_reference(models) -> dict[tuple[int, ...], list[int]]:
    return hf_greedy(models[0])


@pytest.fixture(scope="module")
def looping(models) -> tuple[list[int], list[int]]:
    """A prompt that ends inside the model's own greedy output, where that output repeats its earlier
    stretches (this one does), and the MAX_NEW tokens that follow it: n-gram lookup finds runs to copy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float64)
    start = torch.tensor([[2, 3, 4]])
    out = model.generate(
        start, do_sample=False, max_new_tokens=100 + MAX_NEW, eos_token_id=None, pad_token_id=None
    )
    ids = out[0].tolist()
    return ids[:-MAX_NEW], ids[-MAX_NEW:]


@pytest.fixture(scope="module")
def seeded_reference(models, greedy_reference) -> list[list[int]]:
    """SEEDED over the first prompts, by tpserve's runner and sampler in-process, without speculation."""
    prompts = list(greedy_reference)[: len(SEEDED)]
    runner = ModelRunner(models[0], torch.float64, torch.device("cpu"), TensorParallel())
    runner.allocate_kv_cache(REFERENCE_BLOCKS, BLOCK_SIZE)
    pool = BlockPool(REFERENCE_BLOCKS)
    seqs = [Seq(i, list(p), len(p)) for i, p in enumerate(prompts)]
    driver = Driver(runner)
    driver.add(
        [SequenceInit(s.seq_id, c, 0, s.tokens, s.prompt_len) for s, c in zip(seqs, SEEDED, strict=True)]
    )
    run_step(driver, pool, [(s, s.prompt_len) for s in seqs])
    while len(seqs[0].output) < MAX_NEW:
        run_step(driver, pool, [(s, 1) for s in seqs])
    return [s.output for s in seqs]


PROPOSERS = {
    "ngram": ("--speculative-method", "ngram", "--prompt-lookup-min", "1"),
    "draft": ("--speculative-method", "draft", "--tp", "2", "--swap-space", SWAP_GIB),
}


@pytest.fixture(scope="module", params=sorted(PROPOSERS))
def stack(request, models):
    flags = PROPOSERS[request.param]
    if request.param == "draft":
        flags += ("--speculative-model", str(models[1]))
    with launch(models[0], *COMMON, *flags) as (target, info), grpc.insecure_channel(target) as channel:
        yield request.param, generation_pb2_grpc.GenerationStub(channel), info


def assert_all_blocks_free(stub) -> None:
    stats = stub.GetStats(pb.StatsRequest())
    assert stats.kv_blocks_free == stats.kv_blocks_total == 16
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0


def test_greedy_equals_no_speculation_with_chunks_and_preemption(stack, greedy_reference):
    method, stub, info = stack
    reqs = [
        dict(token_ids=ids, max_new_tokens=MAX_NEW, ignore_eos=True, sampling=GREEDY)
        for ids in greedy_reference
    ]
    for ids, (tokens, _, reason, _) in zip(greedy_reference, run_concurrently(stub, reqs), strict=True):
        assert tokens == greedy_reference[ids], f"{method}: prompt of {len(ids)} tokens"
        assert reason == pb.FINISH_REASON_LENGTH
    assert_all_blocks_free(stub)
    stats = stub.GetStats(pb.StatsRequest())
    assert stats.num_preemptions_total > 0
    # Proposals were made, and some, not all, accepted.
    assert 0 < stats.spec_num_accepted_tokens_total < stats.spec_num_draft_tokens_total
    metrics = scrape(info["metrics_ports"]["scheduler"])
    assert metrics["tpserve_spec_decode_num_draft_tokens_total"] == stats.spec_num_draft_tokens_total
    assert metrics["tpserve_spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    if method == "draft":
        assert metrics.get("tpserve_preemptions_total{kind=swap}", 0) > 0


def test_seeded_sampling_equals_no_speculation(stack, greedy_reference, seeded_reference):
    """Beside unseeded requests, which are drawn by the rejection rule (and must simply complete)."""
    method, stub, _ = stack
    prompts = list(greedy_reference)[: len(SEEDED)]
    seeded = [
        dict(token_ids=ids, max_new_tokens=MAX_NEW, ignore_eos=True, sampling=c.to_proto())
        for ids, c in zip(prompts, SEEDED, strict=True)
    ]
    unseeded = [
        dict(
            token_ids=ids,
            max_new_tokens=MAX_NEW,
            ignore_eos=True,
            sampling=pb.SamplingParams(temperature=1.0),
        )
        for ids in prompts[:3]
    ]
    results = run_concurrently(stub, seeded + unseeded)
    assert [r[0] for r in results[: len(seeded)]] == seeded_reference, method
    assert all(len(r[0]) == MAX_NEW for r in results[len(seeded) :])
    assert_all_blocks_free(stub)


def first_inside_a_run(chunks) -> int | None:
    """The output position of a token inside a step's run (not its last) that does not occur earlier."""
    tokens = [t for c in chunks for t in c.token_ids]
    at = 0
    for c in chunks:
        for j, t in enumerate(c.token_ids[:-1]):
            if t not in tokens[: at + j]:
                return at + j
        at += len(c.token_ids)
    return None


def test_a_stop_inside_an_accepted_run_ends_the_request_there(stack, greedy_reference, looping):
    """Requests alone, so that their steps are the same each time: a message with several tokens is one
    verification's accepted run and the target's token after it. A stop token, then a stop string,
    inside such a run ends the request there; what the step produced after it is dropped."""
    method, stub, _ = stack
    expected = {tuple(looping[0]): looping[1], **greedy_reference}
    for ids in expected:
        request = dict(token_ids=list(ids), max_new_tokens=MAX_NEW, ignore_eos=True, sampling=GREEDY)
        chunks = list(stub.Generate(pb.GenerateRequest(**request), timeout=120))
        inside = first_inside_a_run(chunks)
        if inside is not None:
            break
    assert inside is not None, f"{method}: no multi-token step to stop in"
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == expected[ids]
    stopped, _, reason, _ = generate(stub, **request, stop_token_ids=[tokens[inside]])
    assert stopped == tokens[: inside + 1] and reason == pb.FINISH_REASON_EOS
    assert_all_blocks_free(stub)
    # The first half of a run's text, where it occurs first.
    text, at, stop = "".join(c.text for c in chunks), 0, None
    for c in chunks:
        head = c.text[: max(1, len(c.text) // 2)]
        if stop is None and len(c.token_ids) > 1 and head.strip() and text.find(head) == at:
            stop, stop_at = head, at
        at += len(c.text)
    assert stop is not None, f"{method}: no multi-token step's text to stop in"
    _, stopped_text, reason, _ = generate(stub, **request, stop=[stop])
    assert reason == pb.FINISH_REASON_STOP and stopped_text == text[:stop_at]
    assert_all_blocks_free(stub)
