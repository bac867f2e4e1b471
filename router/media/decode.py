"""An image file's bytes -> RGB pixels and a content hash, refusing what should not be decoded.

The size is read from the header before any pixel is decoded, so a 30000 x 30000 file costs a header
read, not gigabytes (Pillow's own decompression-bomb guard is kept as a second line). The hash is of the
decoded pixels with their size, so the same picture sent as PNG or as a data URL of the same PNG, or by
link, has one hash: the key of the worker's encoder cache and of the prefix cache's image-aware blocks.
Runs on a thread (it decodes), never on the event loop.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image

from router.validation_error import ValidationError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB, fully loaded
    hash: str  # hex sha256 over (width, height, RGB bytes)


def decode_image(data: bytes, max_pixels: int, field: str) -> DecodedImage:
    try:
        with warnings.catch_warnings():
            # Pillow warns (not raises) between MAX_IMAGE_PIXELS and twice it; our limit is checked below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
            width, height = image.size
            if width * height > max_pixels:
                raise ValidationError(
                    field,
                    f"{field}: the image is {width} x {height} = {width * height} pixels; "
                    f"the limit is {max_pixels}",
                )
            image.load()
            rgb = image.convert("RGB")
    except ValidationError:
        raise
    except Image.DecompressionBombError as e:
        # Pillow's own guard, from the header too: far past our limit (twice its 89M pixels).
        raise ValidationError(
            field, f"{field}: the image is too large ({e}); the limit is {max_pixels} pixels"
        ) from None
    except Image.UnidentifiedImageError:
        raise ValidationError(
            field, f"{field}: not an image in a supported format ({', '.join(FORMATS)})"
        ) from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data, as Pillow reports it
        raise ValidationError(field, f"{field}: the image cannot be decoded: {e}") from None
    return DecodedImage(rgb, image_hash(rgb))


def image_hash(rgb: Image.Image) -> str:
    h = hashlib.sha256()
    h.update(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()
