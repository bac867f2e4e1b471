"""Which images a request may bring, and from where: the operator's rules, checked before anything is read.

By default the router reads only what the request itself carries (bytes, data: URLs). A link is fetched
only when its host is one the operator named (--allowed-media-domains, as vLLM's flag), and a local file
only when it lies under --allowed-local-media-path after every symlink and `..` is resolved. Pure: no
I/O but the path resolution, so every rule is unit tested in microseconds.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from common.settings import Rule, at_least, setting, validate
from router.validation_error import ValidationError

# What a data: URL may declare; the decoder checks the bytes themselves against its own list.
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp")


def _is_host(d) -> bool:
    return isinstance(d, str) and bool(d) and not any(c in d for c in "/:@ ")


@dataclass(frozen=True)
class MediaPolicy:
    """The image knobs, declared once (the router's and `tpserve launch`'s flags)."""

    allowed_media_domains: tuple[str, ...] = setting(
        (),
        help="hosts whose http(s) image links the router may fetch (repeatable; exact names, "
        "subdomains not included; unset: no link is fetched)",
        rule=Rule(_is_host, "host names without scheme, port or path"),
        launch=True,
    )
    allowed_local_media_path: str | None = setting(
        None,
        help="a directory whose files requests may name as images (file:// URLs); unset: none",
        launch=True,
    )
    # vLLM's flag takes JSON ({"image": 4}); a bare number is accepted too.
    limit_mm_per_prompt: str = setting(
        '{"image": 4}', help='images per prompt at most, as vLLM: {"image": N} (or just N)', launch=True
    )
    max_image_pixels: int = setting(
        4096 * 4096,
        help="largest image accepted (width x height), checked from its header before it is decoded",
        rule=at_least(1),
        launch=True,
    )
    max_image_bytes: int = setting(
        20 * 2**20, help="largest image file accepted (any source), in bytes", rule=at_least(1), launch=True
    )
    media_fetch_timeout_s: float = setting(
        10.0, help="time allowed for fetching one image link, in seconds", rule=at_least(0.001), launch=True
    )

    def __post_init__(self):
        validate(self)
        self.max_images  # noqa: B018 (parsed now: a bad value is a start-up error)

    @property
    def max_images(self) -> int:
        return parse_mm_limit(self.limit_mm_per_prompt)


def parse_mm_limit(text: str) -> int:
    """--limit-mm-per-prompt: {"image": N} or N, N >= 0; other modalities are not served."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict) and set(value) <= {"image"}:
        value = value.get("image", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f'--limit-mm-per-prompt must be {{"image": N}} or N with N >= 0, got {text!r}')
    return value


@dataclass(frozen=True)
class Source:
    """Where an image's bytes come from, once the policy allowed it: exactly one field is set."""

    data: bytes | None = None  # carried by the request (bytes, or a data: URL's payload)
    http_url: str | None = None  # to fetch, from an allowed host
    path: str | None = None  # a resolved file under the allowed directory


def resolve_source(url: str, policy: MediaPolicy, field: str) -> Source:
    """The source an image URL names, or a ValidationError saying which rule refuses it. Nothing is read."""
    if url.startswith("data:"):
        return Source(data=_data_url(url, policy, field))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        host = (parts.hostname or "").lower()
        if not host or host not in {d.lower() for d in policy.allowed_media_domains}:
            allowed = ", ".join(policy.allowed_media_domains) or "none (the server fetches no links)"
            raise ValidationError(
                field, f"{field}: the host {host or '(none)'!r} is not allowed; allowed hosts: {allowed}"
            )
        if parts.username is not None or parts.password is not None:
            raise ValidationError(field, f"{field}: a link with credentials is not fetched")
        return Source(http_url=url)
    if scheme == "file" or (not scheme and url.startswith("/")):
        return Source(path=_local_path(unquote(parts.path) if scheme else url, policy, field))
    raise ValidationError(
        field,
        f"{field} must be a data: URL, an http(s) link or a file:// URL, got scheme {scheme or 'none'!r}",
    )


def _data_url(url: str, policy: MediaPolicy, field: str) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise ValidationError(field, f"{field}: a data: URL needs a ',' before its payload")
    media_type, *params = header.split(";")
    media_type = media_type.strip().lower()
    if media_type not in IMAGE_MEDIA_TYPES:
        raise ValidationError(
            field,
            f"{field}: media type {media_type or '(none)'!r} is not a supported image type "
            f"({', '.join(IMAGE_MEDIA_TYPES)})",
        )
    if "base64" not in (p.strip().lower() for p in params):
        raise ValidationError(field, f"{field}: an image data: URL must be base64 (';base64,')")
    # Checked before decoding: base64 is 4/3 of the bytes it holds.
    if len(payload) > (policy.max_image_bytes + 2) // 3 * 4 + 4:
        raise ValidationError(field, f"{field}: the image is over {policy.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError(field, f"{field}: the data: URL's payload is not valid base64") from None


def _local_path(path: str, policy: MediaPolicy, field: str) -> str:
    root = policy.allowed_local_media_path
    if root is None:
        raise ValidationError(field, f"{field}: local files are not served (no --allowed-local-media-path)")
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)  # symlinks and '..' resolved: what would really be opened
    if os.path.commonpath([real_root, real]) != real_root:
        raise ValidationError(field, f"{field}: {path!r} is not under the allowed media directory")
    return real
