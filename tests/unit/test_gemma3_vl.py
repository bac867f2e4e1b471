"""Gemma3ForConditionalGeneration through ModelRunner at TP 1, against transformers' generate on the same
processor output: images' soft tokens written over their placeholders, an image's tokens attending to
each other both ways, prompts chunked so that an image's placeholders come in a step of their own, the
encoder run once per picture (the encoder cache), and a text-only prompt as Gemma 3's text model. Float64
on the reference backend and float32 on the CPU backend (the CPU's serving default). The served path
(router, scheduler, TP 2, prefix caching) is tests/e2e/test_vision_serving.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shard_worker.images import PromptImage
from shard_worker.step import SequenceInit
from tests.unit.greedy import new_runner
from tests.unit.test_model_runner import BLOCK_SIZE, GREEDY, BlockPool, Driver, Seq, plan
from tests.vision_models import build_gemma3_vl, hf_greedy_vl, picture

transformers = pytest.importorskip("transformers")
torch.set_flush_denormal(True)

NEW_TOKENS = 8
NUM_BLOCKS = 199


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model):
    return build_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"), tiny_model)


def conversations():
    a, b, c = picture(1), picture(2, (64, 20)), picture(3, (20, 50))
    return [
        [{"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image", "image": a}]}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": b},
                    {"type": "text", "text": "and"},
                    {"type": "image", "image": a},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Two pictures."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "This one?"}, {"type": "image", "image": c}],
            },
        ],
        [{"role": "user", "content": [{"type": "text", "text": "No picture at all, just words."}]}],
    ]


def rendered(processor, messages):
    """(prompt ids, images as the worker gets them) from the processor, as the router renders them."""
    out = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np"
    )
    ids = out["input_ids"][0].tolist()
    image_id = processor.tokenizer.image_token_id
    starts = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]
    pixels = out.get("pixel_values", [])
    images = tuple(
        PromptImage(s, processor.image_seq_length, pixels[k].tobytes(), np.ascontiguousarray(pixels[k]))
        for k, s in enumerate(starts)
    )
    return ids, images


def chunked_greedy(runner, prompts, chunk: int):
    """All sequences at once, each taking up to `chunk` prompt tokens a step, cut before an image it would
    split (as the scheduler does), then one decode token a step."""
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    pool = BlockPool(NUM_BLOCKS)
    seqs = [Seq(i, list(ids), len(ids)) for i, (ids, _) in enumerate(prompts)]
    images = {s.seq_id: imgs for s, (_, imgs) in zip(seqs, prompts, strict=True)}
    driver = Driver(runner)
    driver.add([SequenceInit(s.seq_id, GREEDY, 0, s.tokens, s.prompt_len) for s in seqs])
    while any(len(s.output) < NEW_TOKENS for s in seqs):
        chunks = []
        for s in seqs:
            if len(s.output) >= NEW_TOKENS:
                continue
            start = s.num_computed
            end = min(start + chunk, len(s.tokens))
            for im in images[s.seq_id]:
                if im.offset < end < im.offset + im.length:
                    end = max(start, im.offset) if im.offset > start else im.offset + im.length
            chunks.append((s, end - start))
        inp = plan(pool, chunks)
        inp.sequences = [SimpleNamespace(seq_id=s.seq_id, images=images[s.seq_id]) for s, _ in chunks]
        sampled = [s for (s, _), n in zip(chunks, inp.sample_counts, strict=True) if n]
        out = driver.execute(inp)
        for s, n in chunks:
            s.num_computed += n
        for s, token in zip(sampled, out.token_ids, strict=True):
            s.tokens.append(token)
    return [s.output for s in seqs]


@pytest.mark.parametrize("dtype, backend", [(torch.float64, "reference"), (torch.float32, "cpu")])
def test_greedy_equals_transformers(checkpoint, dtype, backend, one_thread):
    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype)
    want = [hf_greedy_vl(reference, processor, m, NEW_TOKENS) for m in conversations()]
    runner = new_runner(checkpoint, dtype, backend)
    assert runner.attention.name == backend
    got = chunked_greedy(runner, [rendered(processor, m) for m in conversations()], chunk=24)
    assert got == want
    # Picture a is in two prompts: encoded once, taken from the encoder cache for the other.
    assert (runner.encoder_cache.encodes, runner.encoder_cache.hits) == (3, 1)


def test_other_backends_are_refused_at_start(checkpoint):
    with pytest.raises(ValueError, match="--attention-backend flex: .*image's tokens"):
        new_runner(checkpoint, torch.float32, "flex")


def test_prompt_logits_equal_transformers_with_the_bidirectional_mask(checkpoint):
    """Every prompt position's logits in one step, float64: equal to transformers' with its image mask
    (token_type_ids), and measurably not equal to a causal-only forward (so the mask is what is tested)."""
    from shard_worker.attention import StepBatch
    from shard_worker.images import step_images

    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float64)
    messages = conversations()[1]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    inputs["pixel_values"] = inputs["pixel_values"].double()
    with torch.no_grad():
        want = reference(**inputs).logits[0]
        causal = reference(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0]

    runner = new_runner(checkpoint, torch.float64, "reference")
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    ids, images = rendered(processor, messages)
    seq = Seq(0, ids, len(ids))
    inp = plan(BlockPool(NUM_BLOCKS), [(seq, len(ids))])
    inp.sequences = [SimpleNamespace(seq_id=0, images=images)]
    with torch.inference_mode():
        step = step_images(inp, runner.encoder_cache, runner.model.encode_images, runner.device)
        batch = StepBatch.build(
            inp.input_ids, inp.query_lens, inp.context_lens, inp.block_table, BLOCK_SIZE, runner.device,
            image_spans=step.spans,
        )  # fmt: skip
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.attention.context(batch), runner.kv_caches, images=step
        )
        got = runner.model.compute_logits(hidden)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert (causal - want).abs().max() > 1e-2
