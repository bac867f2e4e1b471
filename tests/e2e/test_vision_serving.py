"""Gemma 3 with images served by the real processes (`tpserve launch --tp 2`), against transformers'
generate in float64 on the same processor output: one stack for the module, with chunked prefill forced
(24 tokens a step: every prompt here is chunked, and an image's 16 placeholders come in one step) and
prefix caching on. Through the OpenAI client, curl-shaped HTTP and gRPC: one image, several over two
turns, none; a prompt again on the prefix cache, and the same text with another picture (which must not
be served from the first one's blocks); a picture encoded once on each rank however many prompts bring it
(the workers' counters); bad images refused with 400 and nothing fetched. TP 1 is
tests/unit/test_gemma3_vl.py's (through the model runner, both CPU backends)."""

from __future__ import annotations

import http.server
import io
import struct
import threading
import zlib

import grpc
import openai
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch, post_json
from tests.e2e.test_observability import scrape
from tests.reference import GREEDY, generate
from tests.vision_models import build_gemma3_vl, data_url, hf_greedy_vl, picture, png

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
FLAGS = (
    "--dtype", "float64", "--tp", "2", "--max-num-batched-tokens", "24", "--enable-prefix-caching",
    "--http-port", "0", "--metrics-port", "0", "--allowed-media-domains", "127.0.0.1",
)  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    model = build_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"), tiny_model)
    with launch(model, *FLAGS) as (target, info), grpc.insecure_channel(target) as channel:
        yield model, generation_pb2_grpc.GenerationStub(channel), info


@pytest.fixture(scope="module")
def reference(stack):
    """greedy(messages) -> transformers' tokens, and the processor's tokenizer (to read text)."""
    import torch

    model_dir = stack[0]
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float64)
    return (lambda messages: hf_greedy_vl(model, processor, messages, NEW_TOKENS)), processor.tokenizer


def client(info) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{info['http_port']}/v1", api_key="x", max_retries=0, timeout=120
    )


def hf_parts(parts) -> list[dict]:
    """Our parts (str or PIL picture) as transformers' processor takes them."""
    return [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts
    ]


def grpc_chat(stub, turns) -> tuple[list[int], pb.GenerateResponse]:
    """turns: [(role, [str or picture, ...])]; pictures sent as PNG bytes."""
    messages = [
        pb.ChatMessage(
            role=role,
            parts=[
                pb.ContentPart(text=p) if isinstance(p, str) else pb.ContentPart(image=pb.Image(data=png(p)))
                for p in parts
            ],
        )
        for role, parts in turns
    ]
    tokens, _, _, last = generate(
        stub, messages=messages, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=GREEDY
    )
    return tokens, last


def hf_chat(reference, turns) -> list[int]:
    greedy, _ = reference
    return greedy([{"role": role, "content": hf_parts(parts)} for role, parts in turns])


def test_one_image_through_the_openai_client(stack, reference):
    _, _, info = stack
    a = picture(1)
    c = client(info)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": data_url(a)}},
            ],
        }
    ]
    name = c.models.list().data[0].id
    response = c.chat.completions.create(
        model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    want = hf_chat(reference, [("user", ["What is in this picture?", a])])
    _, tokenizer = reference
    text = tokenizer.decode(want, skip_special_tokens=True)
    assert response.choices[0].message.content == text
    # The prompt counts the image's placeholders (16) and its markers.
    assert response.usage.prompt_tokens > 16
    # curl's shape: the same JSON body, posted bare.
    body = {
        "model": name,
        "messages": messages,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, answer = post_json(info, "/v1/chat/completions", body)
    assert status == 200 and answer["choices"][0]["message"]["content"] == text


def test_several_images_over_two_turns_and_none(stack, reference):
    _, stub, _ = stack
    a, b, c = picture(2, (64, 20)), picture(3), picture(4, (20, 50))
    turns = [
        ("user", [a, "and", b, "side by side"]),
        ("assistant", ["Two pictures."]),
        ("user", ["And this one?", c]),
    ]
    tokens, _ = grpc_chat(stub, turns)
    assert tokens == hf_chat(reference, turns)
    text_only = [("user", ["No picture at all, just words."])]
    tokens, _ = grpc_chat(stub, text_only)
    assert tokens == hf_chat(reference, text_only)


def test_prefix_cache_knows_which_picture_it_holds(stack, reference):
    _, stub, _ = stack
    text = "Tell me about the picture above, please, in a few words."
    a, b = picture(5), picture(6)
    first, _ = grpc_chat(stub, [("user", [a, text])])
    again, last = grpc_chat(stub, [("user", [a, text])])
    assert first == again == hf_chat(reference, [("user", [a, text])])
    assert last.usage.cached_tokens >= 32  # the blocks holding the image were reused
    # The same text and another picture: every placeholder token id is the same, the KV is not.
    other, last = grpc_chat(stub, [("user", [b, text])])
    assert other == hf_chat(reference, [("user", [b, text])])
    assert other != first
    assert last.usage.cached_tokens < 16  # at most the blocks before the image


def test_a_picture_is_encoded_once(stack, reference):
    _, stub, info = stack
    ranks = [p for name, p in info["metrics_ports"].items() if name.startswith("shard-worker")]
    assert len(ranks) == 2
    before = [scrape(p) for p in ranks]
    z = picture(7)
    # Different text before it: the prefix cache cannot serve the image's tokens, the encoder cache can.
    for text in ("Look:", "Another look at this one:"):
        tokens, _ = grpc_chat(stub, [("user", [text, z])])
        assert tokens == hf_chat(reference, [("user", [text, z])])
    for port, old in zip(ranks, before, strict=True):
        now = scrape(port)
        assert now["tpserve_worker_image_encodes_total"] - old["tpserve_worker_image_encodes_total"] == 1
        assert (
            now["tpserve_worker_encoder_cache_hits_total"] - old["tpserve_worker_encoder_cache_hits_total"]
            == 1
        )


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server that records every path it is asked for (it should be asked for none)."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], hits
    server.shutdown()


def huge_png_header(width: int = 30000, height: int = 30000) -> bytes:
    """A PNG whose header says width x height (its pixel data is a few bytes): refused from the header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


def tiff() -> bytes:
    out = io.BytesIO()
    picture(8).save(out, "TIFF")
    return out.getvalue()


def as_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize(
    "url, words",
    [
        (as_url(png(picture(9))[:200]), "cannot be decoded"),  # truncated
        (as_url(huge_png_header()), "too large"),  # Pillow's bomb guard, from the header
        (as_url(tiff()), "not an image in a supported format"),
        ("http://localhost:{port}/a.png", "'localhost' is not allowed"),  # only 127.0.0.1 is named
    ],
    ids=["truncated-png", "30000x30000", "tiff", "host-not-allowed"],
)
def test_bad_images_are_refused_with_400_and_nothing_fetched(stack, image_host, url, words):
    _, _, info = stack
    port, hits = image_host
    content = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": url.format(port=port)}},
    ]
    name = client(info).models.list().data[0].id
    body = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    status, body = post_json(info, "/v1/chat/completions", body)
    assert status == 400, body
    assert body["error"]["param"] == "messages[0].content[1].image_url"
    assert words in body["error"]["message"]
    assert hits == []
