"""A chat prompt with images -> token ids with each image's placeholder tokens, and each image's pixels as
the checkpoint's own processor prepares them (its processor_config / preprocessor_config: size, rescale,
normalisation). transformers' processor does both, so the ids and pixel values are the ones transformers'
model would be given for the same conversation; the placeholders' places are read back from the ids.

Runs on the tokenizer's threads (resizing and normalising take milliseconds per image), never on the
event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.pb.tpserve.internal.v1 import scheduler_pb2
from router.chat import ChatPrompt
from router.media.decode import DecodedImage
from router.validation_error import ValidationError


@dataclass(frozen=True)
class PreparedImage:
    offset: int  # its first placeholder token in the prompt
    length: int  # its placeholder tokens: the rows of the encoder's output written there
    hash: str  # the decoded image's content hash (decode.py)
    # float32, the processor's layout for one image (Gemma 3: [3, H, W]; Qwen VL: its patches as
    # [t, h, w, patch values], the grid the worker's tower and M-RoPE read from the shape)
    pixel_values: np.ndarray


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    images: list[PreparedImage]


def placeholder_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of image_token_id. Families put markers around each image's
    run (Gemma 3's <start_of_image> ... <end_of_image>), so one run is one image."""
    ids = np.asarray(token_ids)
    is_image = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class ImagePromptRenderer:
    """The checkpoint's processor (transformers' AutoProcessor), used for chat prompts that hold images."""

    def __init__(self, processor):
        self.processor = processor
        # The tokenizer's (Gemma 3's names it); Qwen VL's processor (qwen_vl.py) knows its own.
        self.image_token_id = getattr(processor.tokenizer, "image_token_id", None) or processor.image_token_id

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ImagePromptRenderer:
        import transformers

        from router.media.qwen_vl import QwenVLProcessor, is_qwen_vl

        if is_qwen_vl(model_dir):
            return cls(QwenVLProcessor.from_pretrained(model_dir))
        return cls(transformers.AutoProcessor.from_pretrained(model_dir))

    def render(self, text: str, prompt: ChatPrompt, images: list[DecodedImage]) -> RenderedPrompt:
        """text: the chat template's output for prompt (Tokenizer.chat_text), which writes one image marker
        per image part, in the order of images."""
        try:
            out = self.processor(
                text=text,
                images=[d.image for d in images],
                return_tensors="np",
                add_special_tokens=prompt.add_special_tokens,
            )
        except ValueError as e:  # the processor's own check: markers and images do not pair up
            raise ValidationError("messages", f"the images do not fit the prompt: {e}") from None
        ids = out["input_ids"][0].tolist()
        runs = placeholder_runs(ids, self.image_token_id)
        pixels = out["pixel_values"]
        grids = out.get("image_grid_thw")
        if grids is not None:  # Qwen VL: every image's patches in one array, each one's grid beside it
            ends = np.cumsum([int(np.prod(g)) for g in grids])[:-1]
            pixels = [
                p.reshape(*(int(x) for x in g), -1)
                for p, g in zip(np.split(pixels, ends), grids, strict=True)
            ]
        if len(runs) != len(images) or len(pixels) != len(images):
            raise ValidationError(
                "messages",
                f"{len(images)} images gave {len(runs)} placeholder runs and {len(pixels)} pixel arrays "
                "(one each is served: no pan-and-scan crops)",
            )
        return RenderedPrompt(
            ids,
            [
                PreparedImage(offset, length, image.hash, np.ascontiguousarray(p, dtype=np.float32))
                for (offset, length), image, p in zip(runs, images, pixels, strict=True)
            ],
        )


def prompt_images(images: Sequence[PreparedImage]) -> list[scheduler_pb2.PromptImage]:
    """The prepared images as AddRequest carries them to the scheduler (and it to the workers)."""
    return [
        scheduler_pb2.PromptImage(
            offset=im.offset,
            length=im.length,
            hash=bytes.fromhex(im.hash),
            pixel_values=im.pixel_values.astype("<f4", copy=False).tobytes(),
            pixel_shape=list(im.pixel_values.shape),
        )
        for im in images
    ]
