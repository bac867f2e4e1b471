"""The router's Qwen VL processor (router/media/qwen_vl.py) gives what transformers' Qwen2_5_VLProcessor
and Qwen3VLProcessor give for the same text and pictures: token ids with each image's placeholders
expanded to its merged-token count, pixel values, grids and the modality mask. transformers' classes are
built around their constructor, which needs torchvision for a video processor that images never use."""

import numpy as np
import pytest

from router.media.qwen_vl import QwenVLProcessor, is_qwen_vl
from tests.qwen_vl_checkpoints import build_checkpoint
from tests.vision_models import picture

transformers = pytest.importorskip("transformers")

TEXT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and"
    "<|vision_start|><|image_pad|><|vision_end|>?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model):
    return build_checkpoint(
        "qwen2_5_vl", tmp_path_factory.mktemp("qwen-vl-processor"), tokenizer_dir=tiny_model
    )


def transformers_processor(cls, ours: QwenVLProcessor):
    p = cls.__new__(cls)
    tok = ours.tokenizer
    p.image_processor, p.tokenizer, p.video_processor, p.chat_template = ours.image_processor, tok, None, None
    p.image_token, p.video_token = "<|image_pad|>", "<|video_pad|>"
    p.image_token_id, p.video_token_id = ours.image_token_id, tok.convert_tokens_to_ids("<|video_pad|>")
    p.vision_start_token, p.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    p.vision_start_token_id = tok.convert_tokens_to_ids(p.vision_start_token)
    p.vision_end_token_id = tok.convert_tokens_to_ids(p.vision_end_token)
    return p


@pytest.mark.parametrize("cls", ["Qwen2_5_VLProcessor", "Qwen3VLProcessor"])
@pytest.mark.parametrize("special", [False, True])
def test_equal_to_transformers_processor(checkpoint, cls, special):
    ours = QwenVLProcessor.from_pretrained(checkpoint)
    theirs = transformers_processor(getattr(transformers, cls), ours)
    pictures = [picture(1), picture(2, (64, 20))]
    want = theirs(text=TEXT, images=pictures, return_tensors="np", add_special_tokens=special)
    got = ours(TEXT, pictures, add_special_tokens=special)
    for key in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    # 40 x 30 at patch 4 is an 8 x 10 grid, 20 merged tokens; 64 x 20 is 4 x 16, 16.
    assert (got["input_ids"] == ours.image_token_id).sum() == 36


def test_markers_that_do_not_pair_with_the_pictures_are_refused(checkpoint):
    ours = QwenVLProcessor.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match="2 image markers for 1 images"):
        ours(TEXT, [picture(1)])


def test_only_qwen_vl_checkpoints_take_this_processor(checkpoint, tiny_model):
    assert is_qwen_vl(str(checkpoint)) and not is_qwen_vl(str(tiny_model))
