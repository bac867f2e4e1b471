"""Qwen2.5-VL's and Qwen3-VL's processor for images, as transformers' Qwen2_5_VLProcessor and
Qwen3VLProcessor do it: the checkpoint's image processor (dynamic resolution: each picture resized to
multiples of patch x merge pixels within min_pixels and max_pixels, cut into temporal x spatial patches)
and, in the chat template's text, each image's <|image_pad|> repeated once per merged token
(t * h * w / merge**2) before tokenizing. transformers' processor classes cannot be built without
torchvision (their video processor), which the router does not need for images, so the two steps are
taken here from the image processor and the tokenizer the checkpoint names.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCHITECTURES = frozenset({"Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"})
IMAGE_TOKEN = "<|image_pad|>"


def is_qwen_vl(model_dir: str) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(set(config.get("architectures") or ()) & ARCHITECTURES)


class QwenVLProcessor:
    def __init__(self, image_processor, tokenizer):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.merge = image_processor.merge_size

    @classmethod
    def from_pretrained(cls, model_dir: str) -> QwenVLProcessor:
        import transformers

        return cls(
            transformers.AutoImageProcessor.from_pretrained(model_dir),
            transformers.AutoTokenizer.from_pretrained(model_dir),
        )

    def __call__(
        self, text: str, images, return_tensors: str = "np", add_special_tokens: bool = False
    ) -> dict:
        """input_ids [1, L], pixel_values [patches, values] (every image's, in order), image_grid_thw
        [images, 3], mm_token_type_ids [1, L] (1 at image placeholders), as transformers' processor."""
        out = self.image_processor(images=images, return_tensors="np")
        grids = out["image_grid_thw"]
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(grids):
            raise ValueError(f"the text holds {len(pieces) - 1} image markers for {len(grids)} images")
        counts = [int(np.prod(g)) // self.merge**2 for g in grids]
        expanded = pieces[0] + "".join(IMAGE_TOKEN * n + p for n, p in zip(counts, pieces[1:], strict=True))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return {
            "input_ids": np.asarray([ids]),
            "pixel_values": out["pixel_values"],
            "image_grid_thw": grids,
            "mm_token_type_ids": (np.asarray([ids]) == self.image_token_id).astype(np.int32),
        }
