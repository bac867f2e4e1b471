"""An allowed image source's bytes: a link fetched on the event loop (aiohttp, no thread held while the
far host is slow) under a total deadline and a byte cap, a local file read on a thread under the same cap.
Only what policy.resolve_source allowed reaches here; a redirect is not followed, because its target is a
host the operator did not name."""

from __future__ import annotations

import asyncio
import os

import aiohttp

from router.media.policy import MediaPolicy, Source
from router.validation_error import ValidationError

CHUNK = 64 * 1024


async def read_source(
    source: Source, policy: MediaPolicy, field: str, session: aiohttp.ClientSession
) -> bytes:
    if source.data is not None:
        data = source.data
    elif source.path is not None:
        data = await asyncio.to_thread(_read_file, source.path, policy.max_image_bytes, field)
    else:
        data = await _fetch(source.http_url, policy, field, session)
    if len(data) > policy.max_image_bytes:
        raise ValidationError(field, f"{field}: the image is over {policy.max_image_bytes} bytes")
    return data


def _read_file(path: str, max_bytes: int, field: str) -> bytes:
    try:
        if not os.path.isfile(path):
            raise ValidationError(field, f"{field}: {path!r} is not a file")
        with open(path, "rb") as f:
            return f.read(max_bytes + 1)  # one byte over tells the caller it is too large
    except OSError as e:
        raise ValidationError(field, f"{field}: cannot read {path!r}: {e.strerror}") from None


async def _fetch(url: str, policy: MediaPolicy, field: str, session: aiohttp.ClientSession) -> bytes:
    timeout = aiohttp.ClientTimeout(total=policy.media_fetch_timeout_s)
    try:
        async with session.get(url, timeout=timeout, allow_redirects=False) as response:
            if response.status != 200:
                raise ValidationError(field, f"{field}: fetching the image answered HTTP {response.status}")
            if (response.content_length or 0) > policy.max_image_bytes:
                raise ValidationError(field, f"{field}: the image is over {policy.max_image_bytes} bytes")
            data = bytearray()
            async for chunk in response.content.iter_chunked(CHUNK):
                data += chunk
                if len(data) > policy.max_image_bytes:
                    raise ValidationError(field, f"{field}: the image is over {policy.max_image_bytes} bytes")
            return bytes(data)
    except TimeoutError:
        raise ValidationError(
            field, f"{field}: fetching the image took over {policy.media_fetch_timeout_s} s"
        ) from None
    except aiohttp.ClientError as e:
        raise ValidationError(field, f"{field}: cannot fetch the image: {e}") from None
