"""M-RoPE: the (t, h, w) positions of a prompt with images (shard_worker/mrope.py) equal transformers'
get_rope_index for Qwen2.5-VL and Qwen3-VL, decode positions continue by the rope delta as transformers'
generate does, and the rotary layer's cos/sin for 3-row positions equal transformers' text rotary
embeddings (contiguous sections, Qwen3-VL's interleaved ones); 1-row positions give the plain rope."""

import random

import numpy as np
import pytest
import torch

from shard_worker.model.layers.rotary import RotaryEmbedding, RotarySpec, mrope_components
from shard_worker.mrope import prompt_positions
from tests.qwen_vl_checkpoints import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID, hf_config

transformers = pytest.importorskip("transformers")


def _model(family):
    with torch.device("meta"):
        if family == "qwen2_5_vl":
            return transformers.Qwen2_5_VLModel(hf_config(family))
        return transformers.Qwen3VLModel(hf_config(family))


def _prompt(grids, seed=0):
    """Text, then each image framed by its start and end tokens, text between and after."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, 240) for _ in range(rng.randrange(1, 6))]
    for t, h, w in grids:
        ids += [VISION_START_ID] + [IMAGE_TOKEN_ID] * (t * h * w // 4) + [VISION_END_ID]
        ids += [rng.randrange(3, 240) for _ in range(rng.randrange(0, 7))]
    return ids


CASES = [[(1, 4, 6)], [(1, 6, 4), (1, 2, 2)], [(1, 8, 2), (1, 4, 4), (1, 2, 10)], []]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("grids", CASES, ids=["one", "two", "three", "text"])
def test_prompt_positions_equal_get_rope_index(family, grids):
    ids = _prompt(grids, seed=len(grids))
    ours = prompt_positions(ids, IMAGE_TOKEN_ID, grids, merge=2)
    if not grids:  # transformers leaves a text prompt to its default positions: 0, 1, 2, ...
        assert ours.delta == 0 and (ours.prompt == np.arange(len(ids))).all()
        return
    tensor = torch.tensor([ids])
    positions, deltas = _model(family).get_rope_index(
        tensor, mm_token_type_ids=(tensor == IMAGE_TOKEN_ID).int(), image_grid_thw=torch.tensor(grids)
    )
    assert (ours.prompt == positions[:, 0].numpy()).all()
    assert ours.delta == int(deltas[0, 0]) < 0


def test_rows_continue_past_the_prompt_by_the_delta():
    grids = [(1, 4, 6)]
    ids = _prompt(grids)
    table = prompt_positions(ids, IMAGE_TOKEN_ID, grids, merge=2)
    n = len(ids)
    # A chunk across the end of the prompt, as a preempted sequence's recompute takes it.
    rows = table.rows(n - 3, n + 4)
    assert (rows[:, :3] == table.prompt[:, -3:]).all()
    assert (rows[:, 3:] == np.arange(n, n + 4) + table.delta).all()
    assert (table.rows(n + 5, n + 6) == n + 5 + table.delta).all()
    # The first decode position is one past the largest of the prompt's.
    assert table.rows(n, n + 1)[0, 0] == table.prompt.max() + 1


def test_placeholders_that_do_not_match_the_grids_are_refused():
    ids = _prompt([(1, 4, 6)])
    with pytest.raises(ValueError, match="needs 8 placeholders"):
        prompt_positions(ids, IMAGE_TOKEN_ID, [(1, 4, 8)], merge=2)
    with pytest.raises(ValueError, match="fewer image placeholder runs"):
        prompt_positions(ids, IMAGE_TOKEN_ID, [(1, 4, 6), (1, 2, 2)], merge=2)
    with pytest.raises(ValueError, match="more image placeholders"):
        prompt_positions(ids, IMAGE_TOKEN_ID, [], merge=2)


@pytest.mark.parametrize(
    "family, section, interleaved",
    [("qwen2_5_vl", [16, 24, 24], False), ("qwen3_vl", [24, 20, 20], True), ("qwen3_vl", [2, 3, 3], True)],
)
def test_mrope_cos_sin_equal_transformers(family, section, interleaved):
    head_dim = 2 * sum(section) if not interleaved or sum(section) == 64 else 16
    config = hf_config(family).text_config
    config.hidden_size, config.num_attention_heads, config.head_dim = head_dim * 2, 2, head_dim
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if family == "qwen2_5_vl":
        theirs = transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding(config)
    else:
        theirs = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding(config)
    spec = RotarySpec(
        tuple(theirs.inv_freq.tolist()), 1.0, mrope_components(section, head_dim // 2, interleaved)
    )
    ours = RotaryEmbedding(spec)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 3000, (3, 37), generator=generator)
    x = torch.zeros(1, 37, head_dim, dtype=torch.float64)
    cos, sin = theirs(x, positions[:, None, :])
    our_cos, our_sin = ours(positions, torch.float64)
    torch.testing.assert_close(our_cos[:, 0], cos[0], rtol=0, atol=0)
    torch.testing.assert_close(our_sin[:, 0], sin[0], rtol=0, atol=0)
    # Text: three equal rows are the plain rope of one.
    same = positions[:1].expand(3, -1)
    plain = RotaryEmbedding(RotarySpec(spec.inv_freq, 1.0))(positions[0], torch.float64)
    for a, b in zip(ours(same, torch.float64), plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
