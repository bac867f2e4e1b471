"""Qwen2.5-VL and Qwen3-VL through the real processes (`tpserve launch`), against transformers' generate
in float64 on the same processor output (router/media/qwen_vl.py: the checkpoint's image processor at
dynamic resolution, Qwen's placeholder expansion): one stack per configuration (Qwen2.5-VL at --tp 2, its
KV heads and MLP split and the tower replicated; Qwen3-VL, with deepstack, at --tp 1), chunked prefill
forced (32 tokens a step: every image prompt is chunked, each image whole in its step) and the prefix
cache on. Text-only prompts by token ids and by chat; one image (gRPC and the OpenAI HTTP API); pictures
of three sizes over two turns; the same prompt again on the prefix cache, and the same text with another
picture, which the cache must not serve from the first one's blocks. Bad images are
tests/e2e/test_vision_serving.py's (the router's path is the same for every family)."""

from __future__ import annotations

import json
import urllib.request

import grpc
import numpy as np
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from router.media.qwen_vl import QwenVLProcessor
from tests.conftest import launch, post_json
from tests.qwen_vl_checkpoints import build_checkpoint, load_reference
from tests.reference import GREEDY, generate, run_concurrently
from tests.unit.greedy import hf_greedy as hf_greedy_ids
from tests.unit.test_qwen_vl_images import processed
from tests.unit.test_qwen_vl_text import text_prompts
from tests.vision_models import data_url, picture, png

NEW_TOKENS = 8
FLAGS = (
    "--dtype",
    "float64",
    "--max-num-batched-tokens",
    "32",
    "--enable-prefix-caching",
    "--http-port",
    "0",
)
CONFIGS = [("qwen2_5_vl", 2), ("qwen3_vl", 1)]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{f}-tp{tp}" for f, tp in CONFIGS])
def stack(request, tmp_path_factory, tiny_model):
    """(family, gRPC stub, ready info, greedy(turns) -> transformers' tokens): one stack per configuration."""
    import torch

    family, tp = request.param
    model = build_checkpoint(family, tmp_path_factory.mktemp(family), tokenizer_dir=tiny_model)
    reference, processor = load_reference(model), QwenVLProcessor.from_pretrained(model)
    reference.generation_config.eos_token_id = None

    def greedy(turns) -> list[int]:
        inputs = processed(processor, [{"role": r, "content": hf_parts(parts)} for r, parts in turns])
        kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}
        if "pixel_values" in kwargs:
            kwargs["pixel_values"] = kwargs["pixel_values"].double()
        with torch.no_grad():
            out = reference.generate(
                **kwargs,
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )
        return out[0, kwargs["input_ids"].shape[1] :].tolist()

    with launch(model, *FLAGS, "--tp", str(tp)) as (target, info), grpc.insecure_channel(target) as channel:
        yield family, generation_pb2_grpc.GenerationStub(channel), info, greedy, reference, processor


def hf_parts(parts) -> list[dict]:
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


def test_text_prompts_serve_transformers_tokens(stack):
    family, stub, _, greedy, reference, _ = stack
    prompts = text_prompts()
    want = hf_greedy_ids(reference, prompts, NEW_TOKENS)
    requests = [
        dict(token_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=GREEDY) for ids in prompts
    ]
    assert [tokens for tokens, *_ in run_concurrently(stub, requests)] == want, family
    chat = [("user", ["No picture at all, just words."])]
    assert grpc_chat(stub, chat)[0] == greedy(chat)


def test_one_image_over_grpc_and_http(stack):
    family, stub, info, greedy, _, processor = stack
    a = picture(1)
    turns = [("user", ["What is in this picture?", a])]
    want = greedy(turns)
    tokens, last = grpc_chat(stub, turns)
    assert tokens == want, family
    assert last.usage.prompt_tokens > 20  # the image's 20 placeholders and its markers
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": data_url(a)}},
    ]
    body = {
        "model": served_name(info),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, answer = post_json(info, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == processor.tokenizer.decode(
        want, skip_special_tokens=True
    )


def served_name(info) -> str:
    """The model's name on /v1/models."""
    with urllib.request.urlopen(f"http://127.0.0.1:{info['http_port']}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def test_pictures_of_three_sizes_over_two_turns(stack):
    family, stub, _, greedy, _, _ = stack
    a, b, c = picture(2, (64, 20)), picture(3), picture(4, (20, 50))
    turns = [
        ("user", [a, "and", b, "side by side"]),
        ("assistant", ["Two pictures."]),
        ("user", ["And this?", c]),
    ]
    assert grpc_chat(stub, turns)[0] == greedy(turns), family


def test_prefix_cache_knows_which_picture_it_holds(stack):
    family, stub, _, greedy, _, _ = stack
    text = "Tell me about the picture above, please, in a few words."
    a, b = picture(5), picture(6)
    first, _ = grpc_chat(stub, [("user", [a, text])])
    again, last = grpc_chat(stub, [("user", [a, text])])
    assert first == again == greedy([("user", [a, text])]), family
    assert last.usage.cached_tokens >= 32  # the blocks holding the image were reused
    # The same text and another picture of the same size: the same token ids, another KV.
    other, last = grpc_chat(stub, [("user", [b, text])])
    assert other == greedy([("user", [b, text])]) and other != first
    assert last.usage.cached_tokens < 16  # at most the blocks before the image
