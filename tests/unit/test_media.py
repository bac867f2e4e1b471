"""Images in chat requests: the fetch policy (pure), decoding limits, the content hash, the OpenAI parts, and
the loader end to end against a local HTTP server that counts what it was asked for."""

import asyncio
import base64
import io
import os
import struct
import zlib

import pytest
from aiohttp import web
from PIL import Image

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.chat import chat_prompt
from router.media.decode import decode_image
from router.media.loader import MediaLoader, image_parts
from router.media.policy import MediaPolicy, Source, parse_mm_limit, resolve_source
from router.openai.errors import ApiError
from router.openai.protocol import parse_chat
from router.validation_error import ValidationError

F = "messages[0].content[0].image_url"


def png(width=8, height=8, color=(10, 20, 30), fmt="PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def huge_png_header(width=30000, height=30000) -> bytes:
    """A valid PNG header claiming width x height with almost no pixel data (a decompression bomb)."""

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


# ---- the policy: nothing allowed unless the operator said so ----


def test_by_default_only_what_the_request_carries_is_read():
    policy = MediaPolicy()
    assert resolve_source(data_url(b"x"), policy, F) == Source(data=b"x")
    for url, words in [
        ("https://example.com/cat.png", "not allowed"),
        ("file:///etc/passwd", "local files are not served"),
        ("/etc/passwd", "local files are not served"),
        ("ftp://example.com/a.png", "scheme 'ftp'"),
        ("cat.png", "scheme 'none'"),
    ]:
        with pytest.raises(ValidationError, match=words) as e:
            resolve_source(url, policy, F)
        assert e.value.field == F


def test_links_only_to_named_hosts_and_without_credentials():
    policy = MediaPolicy(allowed_media_domains=("images.example.com",))
    url = "https://Images.Example.com:8443/a.png?x=1"
    assert resolve_source(url, policy, F) == Source(http_url=url)
    for refused in (
        "https://example.com/a.png",  # the parent domain is another host
        "https://evil.images.example.com/a.png",  # so is a subdomain
        "https://images.example.com.evil.org/a.png",
        "http://evil.org/images.example.com/a.png",
        "https://u:p@images.example.com/a.png",
    ):
        with pytest.raises(ValidationError):
            resolve_source(refused, policy, F)


def test_local_files_only_under_the_directory_after_resolving_links(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    os.symlink(tmp_path / "secret.png", root / "link.png")
    policy = MediaPolicy(allowed_local_media_path=str(root))
    assert resolve_source(f"file://{root}/a.png", policy, F).path == str((root / "a.png").resolve())
    for refused in (f"file://{root}/../secret.png", f"{root}/link.png", str(tmp_path / "secret.png")):
        with pytest.raises(ValidationError, match="not under the allowed media directory"):
            resolve_source(refused, policy, F)


def test_data_urls_must_be_base64_images_within_the_byte_limit():
    policy = MediaPolicy(max_image_bytes=100)
    for url, words in [
        (data_url(b"x", "text/plain"), "not a supported image type"),
        ("data:image/png,rawtext", "must be base64"),
        ("data:image/png;base64", "needs a ','"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        (data_url(b"x" * 200), "over 100 bytes"),
    ]:
        with pytest.raises(ValidationError, match=words):
            resolve_source(url, policy, F)


def test_limit_mm_per_prompt_takes_vllm_json_or_a_number():
    assert parse_mm_limit('{"image": 3}') == 3 and parse_mm_limit("0") == 0 and parse_mm_limit("{}") == 0
    for bad in ('{"video": 1}', "-1", "x", '{"image": true}'):
        with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
            parse_mm_limit(bad)
    with pytest.raises(ValueError, match="--allowed-media-domains"):
        MediaPolicy(allowed_media_domains=("https://x.org",))


# ---- decoding: limits from the header, corrupt and unsupported data refused, one hash per picture ----


def test_decode_refuses_corrupt_huge_and_unsupported_images():
    good = png(64, 64)
    cases = [
        (good[: len(good) // 2], "cannot be decoded"),  # truncated
        (b"not an image at all", "not an image in a supported format"),
        (png(fmt="TIFF"), "not an image in a supported format"),
        (huge_png_header(), "too large|pixels"),
        (huge_png_header(100, 100), "10000 pixels; the limit is 4096"),
    ]
    for data, words in cases:
        with pytest.raises(ValidationError, match=words) as e:
            decode_image(data, 64 * 64, F)
        assert e.value.field == F


def test_the_hash_is_of_the_pixels_not_the_file():
    a = decode_image(png(color=(1, 2, 3)), 10**6, F)
    assert a.image.mode == "RGB" and a.image.size == (8, 8)
    assert decode_image(png(color=(1, 2, 3), fmt="BMP"), 10**6, F).hash == a.hash
    assert decode_image(png(color=(1, 2, 4)), 10**6, F).hash != a.hash
    assert decode_image(png(4, 16, color=(1, 2, 3)), 10**6, F).hash != a.hash  # same bytes, other shape


# ---- the OpenAI body: image_url parts keep their place among the text ----


def test_image_url_parts_travel_in_order_and_render_as_template_image_parts():
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is"},
                    {"type": "image_url", "image_url": {"url": "https://a.org/x.png"}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
                ],
            },
        ]
    }
    req = parse_chat(body, "id").generate
    assert req.messages[0].content == "be brief" and not req.messages[0].parts
    assert [p.WhichOneof("kind") for p in req.messages[1].parts] == ["text", "image", "text", "image"]
    assert [f for f, _ in image_parts(req)] == [
        "messages[1].content[1].image_url",
        "messages[1].content[3].image_url",
    ]
    assert chat_prompt(req).messages[1]["content"] == [
        {"type": "text", "text": "what is"},
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
    ]
    for part in ({"type": "image_url", "image_url": {}}, {"type": "audio"}):
        with pytest.raises(ApiError):
            parse_chat({"messages": [{"role": "user", "content": [part]}]}, "id")


# ---- the loader: cheap refusals first, nothing fetched that the policy or the model refuses ----


def chat_with_images(*urls: str) -> pb.GenerateRequest:
    parts = [pb.ContentPart(text="look")] + [pb.ContentPart(image=pb.Image(url=u)) for u in urls]
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", parts=parts)])


@pytest.fixture
def image_host():
    """A local HTTP server: /a.png an image, /big 2 MB, /slow never answers in time, /moved a redirect."""
    hits: list[str] = []
    loop = asyncio.new_event_loop()

    async def handle(request: web.Request):
        hits.append(request.path)
        if request.path == "/slow":
            await asyncio.sleep(1)
        if request.path == "/moved":
            raise web.HTTPFound("http://localhost/a.png")
        if request.path == "/big":
            return web.Response(body=b"\0" * 2**21)
        return web.Response(body=png(16, 16), content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", handle)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    yield loop, f"http://127.0.0.1:{port}", hits
    loop.run_until_complete(runner.cleanup())
    loop.close()


def load(loop, loader: MediaLoader, req):
    async def go():
        try:
            return await loader.load(req)
        finally:
            await loader.close()

    return loop.run_until_complete(go())


def test_loader_fetches_allowed_links_and_refuses_the_rest_unread(image_host):
    loop, base, hits = image_host
    allowed = MediaPolicy(
        allowed_media_domains=("127.0.0.1",), max_image_bytes=2**20, media_fetch_timeout_s=0.5
    )
    images = load(loop, MediaLoader(allowed, True), chat_with_images(f"{base}/a.png", data_url(png(16, 16))))
    assert [i.image.size for i in images] == [(16, 16), (16, 16)] and images[0].hash == images[1].hash
    assert hits == ["/a.png"]

    hits.clear()
    refusals = [
        (MediaPolicy(), (f"{base}/a.png",), "not allowed"),  # no hosts named
        (allowed, (data_url(png()),) * 5, "5 images; the limit is 4"),
        (MediaPolicy(limit_mm_per_prompt='{"image": 0}'), (data_url(png()),), "1 images; the limit is 0"),
    ]
    for policy, urls, words in refusals:
        with pytest.raises(ValidationError, match=words):
            load(loop, MediaLoader(policy, True), chat_with_images(*urls))
    with pytest.raises(ValidationError, match="does not take images"):
        load(loop, MediaLoader(allowed, False), chat_with_images(f"{base}/a.png"))
    assert hits == []  # none of those was fetched

    for path, words in [("/big", "over 1048576 bytes"), ("/slow", "took over 0.5 s"), ("/moved", "HTTP 302")]:
        with pytest.raises(ValidationError, match=words):
            load(loop, MediaLoader(allowed, True), chat_with_images(base + path))


def test_anthropic_image_blocks_become_image_parts():
    from router.anthropic.protocol import parse_messages

    blocks = [
        {"type": "text", "text": "compare"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://a.org/b.png"}},
    ]
    req = parse_messages({"max_tokens": 5, "messages": [{"role": "user", "content": blocks}]}, "r").generate
    parts = req.messages[0].parts
    assert [p.WhichOneof("kind") for p in parts] == ["text", "image", "image"]
    assert [parts[1].image.url, parts[2].image.url] == ["data:image/png;base64,AAAA", "https://a.org/b.png"]
