"""A chat prompt with images rendered by the checkpoint's own processor: the token ids and pixel values
equal what transformers' processor gives for the same conversation (its own chat templating with images),
and each image's placeholders are found where they are."""

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from router.chat import chat_prompt
from router.media.loader import MediaLoader
from router.media.policy import MediaPolicy
from router.media.render import ImagePromptRenderer, placeholder_runs
from router.openai.protocol import parse_chat
from router.tokenizer import Tokenizer
from router.validation_error import ValidationError
from tests.conftest import ROOT

transformers = pytest.importorskip("transformers")

# Gemma 3's template in miniature: an image part is the <start_of_image> marker the processor expands.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<start_of_image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SEQ_LEN = 4  # soft tokens per image (256 in the real checkpoints)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Gemma 3 processor directory with a small image size, on the tiny test model's tokenizer (Gemma's
    262k-token one takes tens of seconds to load on a busy machine) given Gemma's markers."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    markers = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    tok = transformers.AutoTokenizer.from_pretrained(ROOT / "models" / "tiny", extra_special_tokens=markers)
    tok.add_special_tokens(
        {"additional_special_tokens": [*markers.values(), "<start_of_turn>", "<end_of_turn>"]}
    )
    tok.chat_template = TEMPLATE
    processor = transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
        tokenizer=tok,
        image_seq_length=SEQ_LEN,
        chat_template=TEMPLATE,
    )
    out = tmp_path_factory.mktemp("gemma3-processor")
    processor.save_pretrained(out)
    return str(out)


def picture(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_placeholder_runs():
    assert placeholder_runs([1, 9, 9, 2, 9, 3, 9, 9, 9], 9) == [(1, 2), (4, 1), (6, 3)]
    assert placeholder_runs([1, 2], 9) == [] and placeholder_runs([], 9) == []


def test_ids_and_pixels_equal_transformers_processor(checkpoint):
    a, b = picture(1), picture(2, (64, 20))
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare "},
                    {"type": "image_url", "image_url": {"url": url(a)}},
                ],
            },
            {"role": "assistant", "content": "A picture."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url(b)}},
                    {"type": "text", "text": "and this one."},
                ],
            },
        ]
    }
    req = parse_chat(body, "r").generate
    tok = Tokenizer.from_pretrained(checkpoint)
    loader = MediaLoader(MediaPolicy(), takes_images=True)
    decoded = asyncio.run(loader.load(req))
    prompt = chat_prompt(req)
    rendered = ImagePromptRenderer.from_pretrained(checkpoint).render(tok.chat_text(prompt), prompt, decoded)

    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": a}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
        {
            "role": "user",
            "content": [{"type": "image", "image": b}, {"type": "text", "text": "and this one."}],
        },
    ]
    ref = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np"
    )
    assert rendered.token_ids == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(np.stack([i.pixel_values for i in rendered.images]), ref["pixel_values"])
    image_id = processor.tokenizer.image_token_id
    for image, d in zip(rendered.images, decoded, strict=True):
        assert image.length == SEQ_LEN and image.hash == d.hash
        assert rendered.token_ids[image.offset : image.offset + image.length] == [image_id] * SEQ_LEN
        assert rendered.token_ids[image.offset - 1] == processor.tokenizer.boi_token_id
    tok.close()


def test_images_that_do_not_fit_the_prompt_are_refused(checkpoint):
    renderer = ImagePromptRenderer.from_pretrained(checkpoint)
    loader = MediaLoader(MediaPolicy(), takes_images=True)
    req = parse_chat(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(picture(3))}}]}
            ]
        },
        "r",
    ).generate
    decoded = asyncio.run(loader.load(req))
    prompt = chat_prompt(req)
    with pytest.raises(ValidationError):
        renderer.render("no marker here", prompt, decoded)
