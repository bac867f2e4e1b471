"""A chat request's images, from its parts to decoded pixels, in the order the prompt places them.

The cheap refusals come first and read nothing: too many images, a source the policy does not allow, a
model that does not take images. Only then are bytes read (links fetched on the event loop, files and
decoding on the media thread) and decoded under the pixel limit.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

from common.pb.tpserve.v1 import generation_pb2
from router.media import qwen_vl
from router.media.decode import DecodedImage, decode_image
from router.media.fetch import read_source
from router.media.policy import MediaPolicy, Source, resolve_source
from router.validation_error import ValidationError

# The architectures whose images a shard worker can encode (shard_worker/model/registry.py); any other
# model's image parts are refused, after the policy checks, with a clear 400.
VISION_ARCHITECTURES: frozenset[str] = frozenset({"Gemma3ForConditionalGeneration"}) | qwen_vl.ARCHITECTURES


def image_parts(req: generation_pb2.GenerateRequest) -> list[tuple[str, generation_pb2.Image]]:
    """(field, image) for each image part of the conversation, in prompt order."""
    return [
        (f"messages[{i}].content[{j}].image_url", part.image)
        for i, m in enumerate(req.messages)
        for j, part in enumerate(m.parts)
        if part.WhichOneof("kind") == "image"
    ]


def takes_images(model_dir: str) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):  # a .gguf file, or no config: a text model
        return False
    return bool(set(config.get("architectures") or ()) & VISION_ARCHITECTURES)


class MediaLoader:
    def __init__(self, policy: MediaPolicy, takes_images: bool):
        self.policy = policy
        self.takes_images = takes_images
        # Decoding a large image takes tens of milliseconds: its own thread, not the tokenizer's.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="media")
        self._session: aiohttp.ClientSession | None = None

    async def load(self, req: generation_pb2.GenerateRequest) -> list[DecodedImage]:
        parts = image_parts(req)
        if not parts:
            return []
        if len(parts) > self.policy.max_images:
            raise ValidationError(
                "messages",
                f"messages hold {len(parts)} images; the limit is {self.policy.max_images} "
                "(--limit-mm-per-prompt)",
            )
        sources = [(field, _source(image, self.policy, field)) for field, image in parts]
        if not self.takes_images:
            raise ValidationError(parts[0][0], f"{parts[0][0]}: the served model does not take images")
        datas = await asyncio.gather(*(self._read(source, field) for field, source in sources))
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(
                *(
                    loop.run_in_executor(self._pool, decode_image, data, self.policy.max_image_pixels, field)
                    for (field, _), data in zip(sources, datas, strict=True)
                )
            )
        )

    async def _read(self, source: Source, field: str) -> bytes:
        if source.http_url is not None and self._session is None:
            self._session = aiohttp.ClientSession()
        return await read_source(source, self.policy, field, self._session)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _source(image: generation_pb2.Image, policy: MediaPolicy, field: str) -> Source:
    if image.WhichOneof("source") == "data":
        if len(image.data) > policy.max_image_bytes:
            raise ValidationError(field, f"{field}: the image is over {policy.max_image_bytes} bytes")
        return Source(data=image.data)
    if not image.url:
        raise ValidationError(field, f"{field}: an image needs data or a url")
    return resolve_source(image.url, policy, field)
