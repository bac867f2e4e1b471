"""Qwen2.5-VL and Qwen3-VL with images through ModelRunner at TP 1, in float64, against transformers'
generate on the same processor output (router/media/qwen_vl.py's, which the router serves): pictures of
different sizes (dynamic resolution: their own grids), one image, three over two turns, none; prompts
chunked with images whole in a step; the tower's rows (and Qwen3-VL's deepstack features) over the
placeholders, M-RoPE positions from each prompt's table and past it by the rope delta; the same picture
in two prompts encoded once. The served path (router, scheduler, TP 2, prefix caching) is
tests/e2e/test_qwen_vl_serving.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from router.media.qwen_vl import QwenVLProcessor
from router.media.render import placeholder_runs
from shard_worker.images import PromptImage
from shard_worker.step import SequenceInit
from tests.qwen_vl_checkpoints import FAMILIES, build_checkpoint, load_reference
from tests.unit.greedy import new_runner
from tests.unit.test_model_runner import BLOCK_SIZE, GREEDY, BlockPool, Driver, Seq, plan
from tests.vision_models import picture

torch.set_flush_denormal(True)

NEW_TOKENS = 8
NUM_BLOCKS = 199


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory, tiny_model):
    path = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir=tiny_model)
    return request.param, path


def conversations():
    # 40 x 30 is resized to 40 x 32 (an 8 x 10 patch grid: 20 tokens), 64 x 20 to 64 x 16 (4 x 16: 16),
    # 20 x 50 to 16 x 48 (12 x 4: 12).
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


def processed(processor: QwenVLProcessor, messages) -> dict:
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [
        p["image"] for m in messages for p in m["content"] if isinstance(p, dict) and p["type"] == "image"
    ]
    if not images:
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": np.asarray([ids])}
    return processor(text, images)


def hf_greedy(model, inputs: dict) -> list[int]:
    kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}
    if "pixel_values" in kwargs:
        kwargs["pixel_values"] = kwargs["pixel_values"].to(model.dtype)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            **kwargs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0
        )
    return out[0, kwargs["input_ids"].shape[1] :].tolist()


def worker_images(processor, inputs: dict) -> tuple[list[int], tuple[PromptImage, ...]]:
    """(prompt ids, images as the worker gets them: [t, h, w, values] pixels, as the router packs them)."""
    ids = inputs["input_ids"][0].tolist()
    if "pixel_values" not in inputs:
        return ids, ()
    grids = inputs["image_grid_thw"]
    ends = np.cumsum([int(np.prod(g)) for g in grids])[:-1]
    pixels = [p.reshape(*g, -1) for p, g in zip(np.split(inputs["pixel_values"], ends), grids, strict=True)]
    runs = placeholder_runs(ids, processor.image_token_id)
    return ids, tuple(
        PromptImage(offset, length, p.tobytes()[:32], np.ascontiguousarray(p, dtype=np.float32))
        for (offset, length), p in zip(runs, pixels, strict=True)
    )


def chunked_greedy(runner, prompts, chunk: int):
    """Every sequence at once, up to `chunk` prompt tokens a step, cut before an image it would split (as
    the scheduler does), then a decode token a step; each sequence's M-RoPE table as the worker makes it."""
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    pool = BlockPool(NUM_BLOCKS)
    seqs = [Seq(i, list(ids), len(ids)) for i, (ids, _) in enumerate(prompts)]
    views = {
        s.seq_id: SimpleNamespace(
            seq_id=s.seq_id, images=images, mrope=runner.model.prompt_positions(ids, images)
        )
        for s, (ids, images) in zip(seqs, prompts, strict=True)
    }
    driver = Driver(runner)
    driver.add([SequenceInit(s.seq_id, GREEDY, 0, s.tokens, s.prompt_len) for s in seqs])
    while any(len(s.output) < NEW_TOKENS for s in seqs):
        chunks = []
        for s in seqs:
            if len(s.output) >= NEW_TOKENS:
                continue
            start = s.num_computed
            end = min(start + chunk, len(s.tokens))
            for im in views[s.seq_id].images:
                if im.offset < end < im.offset + im.length:
                    end = max(start, im.offset) if im.offset > start else im.offset + im.length
            chunks.append((s, end - start))
        inp = plan(pool, chunks)
        inp.sequences = [views[s.seq_id] for s, _ in chunks]
        sampled = [s for (s, _), n in zip(chunks, inp.sample_counts, strict=True) if n]
        out = driver.execute(inp)
        for s, n in chunks:
            s.num_computed += n
        for s, token in zip(sampled, out.token_ids, strict=True):
            s.tokens.append(token)
    return [s.output for s in seqs]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32-cpu"])
def test_greedy_equals_transformers(checkpoint, dtype, one_thread):
    """float32 runs the CPU attention kernel and its in-place rotary (the CPU's serving path)."""
    family, path = checkpoint
    processor = QwenVLProcessor.from_pretrained(path)
    inputs = [processed(processor, m) for m in conversations()]
    assert [g.tolist() for g in inputs[1]["image_grid_thw"]] == [[1, 4, 16], [1, 8, 10], [1, 12, 4]]
    reference = load_reference(path, dtype)
    want = [hf_greedy(reference, x) for x in inputs]
    runner = new_runner(path, dtype)
    assert dtype == torch.float64 or runner.attention.name == "cpu"
    got = chunked_greedy(runner, [worker_images(processor, x) for x in inputs], chunk=24)
    assert got == want, family
    # Picture a is in two prompts: encoded once, taken from the encoder cache for the other.
    assert (runner.encoder_cache.encodes, runner.encoder_cache.hits) == (3, 1)


def test_images_change_the_output(checkpoint, one_thread):
    """The same text with another picture (of the same size) decodes otherwise: the rows are used."""
    family, path = checkpoint
    processor = QwenVLProcessor.from_pretrained(path)
    runner = new_runner(path, torch.float64)
    prompts = []
    for seed in (1, 4):
        messages = [{"role": "user", "content": [{"type": "image", "image": picture(seed)}]}]
        prompts.append(worker_images(processor, processed(processor, messages)))
    assert prompts[0][0] == prompts[1][0]
    first, second = chunked_greedy(runner, prompts, chunk=64)
    assert first != second, family
