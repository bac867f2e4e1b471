"""The Qwen2.5-VL and Qwen3-VL vision towers (shard_worker/model/qwen_vl_vision.py) loaded from random
checkpoints that transformers writes: their image embeddings (and Qwen3-VL's deepstack features) equal
transformers' get_image_features on the same patches, for images whose grids cut windows short, several
images at once, and a two-slice (t = 2) input."""

import pytest
import torch
from safetensors.torch import load_file

from shard_worker.model.qwen_vl_vision import Qwen2_5_VisionTransformer, Qwen3VLVisionModel, window_order
from tests.qwen_vl_checkpoints import build_checkpoint, load_reference

# (t, h, w) in patches: 6 x 10 has windows of 2 x 2 merge blocks cut at the right edge, 4 x 4 exactly two
# by two windows, 2 x 6 one row of them; t = 2 is a video's two slices.
GRIDS = [(1, 6, 10), (1, 4, 4), (2, 2, 6)]
TOWERS = {"qwen2_5_vl": Qwen2_5_VisionTransformer, "qwen3_vl": Qwen3VLVisionModel}


@pytest.fixture(scope="module", params=sorted(TOWERS))
def tower(request, tmp_path_factory):
    torch.set_flush_denormal(True)
    path = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    reference = load_reference(path)
    ours = TOWERS[request.param](reference.config.vision_config)
    ours.load(load_file(path / "model.safetensors"))
    return request.param, ours.double(), reference


def _pixels(grids, seed=0):
    generator = torch.Generator().manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, 3 * 2 * 4 * 4, dtype=torch.float64, generator=generator)


@pytest.mark.parametrize(
    "grids", [GRIDS, GRIDS[:1], GRIDS[1:2]], ids=["three", "windows-cut", "one-window-row"]
)
def test_image_embeddings_equal_transformers(tower, grids):
    family, ours, reference = tower
    pixels = _pixels(grids)
    with torch.no_grad():
        out = ours(pixels, grids)
        theirs = reference.model.get_image_features(pixels, torch.tensor(grids))
    embeds, deepstack = out if family == "qwen3_vl" else (out, None)
    assert embeds.shape == (sum(ours.num_tokens(grids)), 64)
    torch.testing.assert_close(embeds, torch.cat(theirs.pooler_output), rtol=1e-9, atol=1e-9)
    if deepstack is not None:
        assert len(deepstack) == 2
        for a, b in zip(deepstack, theirs.deepstack_features, strict=True):
            torch.testing.assert_close(a, torch.cat(b), rtol=1e-9, atol=1e-9)


def test_each_image_alone_is_its_share_of_the_batch(tower):
    """Attention never crosses images: an image's embeddings do not depend on its neighbours."""
    family, ours, _ = tower
    with torch.no_grad():
        together = ours(_pixels(GRIDS), GRIDS)
        together = together[0] if family == "qwen3_vl" else together
        alone = ours(_pixels(GRIDS)[:60], GRIDS[:1])
        alone = alone[0] if family == "qwen3_vl" else alone
    torch.testing.assert_close(together[:15], alone, rtol=1e-9, atol=1e-9)


def test_windows_tile_each_slice():
    order, lengths = window_order([(1, 6, 10), (2, 4, 4)], merge=2, window=2)
    # 3 x 5 blocks in windows of 2 x 2: row 0 has 2, 2, 1 wide windows two high, row 1 one high.
    assert lengths[:6] == [16, 16, 8, 8, 8, 4]
    assert order[:8].tolist() == [0, 1, 5, 6, 2, 3, 7, 8]
    # The 2 x 2 blocks of each of the second input's slices are one window each.
    assert lengths[6:] == [16, 16] and sorted(order.tolist()) == list(range(15 + 8))


def test_a_checkpoint_without_the_tower_is_refused(tower):
    _, ours, reference = tower
    with pytest.raises(ValueError, match="lacks the vision tower's"):
        type(ours)(reference.config.vision_config).load(
            {"model.language_model.embed_tokens.weight": torch.zeros(1)}
        )


def test_a_grid_that_does_not_match_the_patches_is_refused(tower):
    _, ours, _ = tower
    with pytest.raises(ValueError, match="patches for images"):
        ours(_pixels(GRIDS[:1]), GRIDS[1:2])
