"""Qwen2.5-VL and Qwen3-VL as language models through ModelRunner, in float64: a checkpoint that
transformers writes loads (its text model mapped from model.language_model.*, its tower's tensors left
to the tower), text-only prompts chunked over several steps decode transformers' greedy tokens, and the
published Qwen2.5-VL layout (model.*, visual.*) loads the same weights."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.qwen_vl_checkpoints import FAMILIES, build_checkpoint, load_reference
from tests.unit.greedy import hf_greedy, new_runner
from tests.unit.test_model_families import chunked_greedy

torch.set_flush_denormal(True)

NEW_TOKENS = 10


def text_prompts(seed: int = 7) -> list[list[int]]:
    """Token ids below the image and frame ids (a text prompt holds none of them)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 240) for _ in range(n)] for n in (3, 17, 41)]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return request.param, build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_text_prompts_decode_like_transformers(checkpoint):
    family, path = checkpoint
    runner = new_runner(path, torch.float64)
    assert runner.config.image_token_id == 250 and runner.config.spatial_merge_size == 2
    want = hf_greedy(load_reference(path), text_prompts(), NEW_TOKENS)
    assert chunked_greedy(runner, text_prompts(), NEW_TOKENS) == want


def test_the_published_layout_loads_the_same_weights(checkpoint, tmp_path):
    """Qwen2.5-VL's files on the hub predate transformers 5: model.layers.*, visual.*."""
    family, path = checkpoint
    tensors = load_file(path / "model.safetensors")
    renamed = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
        for k, v in tensors.items()
    }
    assert any(k.startswith("visual.") for k in renamed)
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    save_file(renamed, tmp_path / "model.safetensors")
    ours, again = new_runner(path, torch.float64).model, new_runner(tmp_path, torch.float64).model
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
