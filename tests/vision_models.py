"""A small random Gemma3ForConditionalGeneration checkpoint with its processor, built with transformers'
classes, and pictures drawn for it: what the vision tests (and bench/vision.py) serve.

The tokenizer is the tiny test model's (tests/conftest.py) with Gemma 3's markers and turn tokens added
(Gemma's own 262k-token one takes tens of seconds to load on a busy machine), and the chat template is
Gemma 3's in miniature: an image part is <start_of_image>, which the processor expands into
"\\n\\n<start_of_image>" + image_seq_length x <image_soft_token> + "<end_of_image>\\n\\n".
Weights are drawn larger than usual (norms and the projector included), so that next-token distributions
are peaked and an image's soft tokens move the output: two pictures give two different continuations.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<start_of_image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MARKERS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
LOGIT_STD = 4.0


def build_gemma3_vl(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    image_size: int = 32,
    patch_size: int = 4,
    tokens_per_image: int = 16,
    hidden: int = 64,
    layers: int = 3,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    seed: int = 0,
) -> Path:
    """Writes the checkpoint (config.json, safetensors, generation_config.json) and its processor
    (tokenizer, chat template, processor and image processor configs) to out_dir."""
    import transformers as t
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out = Path(out_dir)
    tok = t.AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens=MARKERS)
    tok.add_special_tokens(
        {"additional_special_tokens": [*MARKERS.values(), "<start_of_turn>", "<end_of_turn>"]}
    )
    tok.chat_template = TEMPLATE
    processor = t.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}),
        tokenizer=tok,
        image_seq_length=tokens_per_image,
        chat_template=TEMPLATE,
    )
    vocab = -(-len(tok) // 16) * 16
    text = t.Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.25,
        # Window 20, the last layer global: an image's 16 tokens and the text around them cross a window.
        sliding_window=20,
        layer_types=(["sliding_attention"] * (layers - 1) + ["full_attention"]),
        query_pre_attn_scalar=24,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )
    vision = t.SiglipVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        vision_use_head=False,
    )
    config = t.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
        tie_word_embeddings=False,
        initializer_range=0.25,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = t.Gemma3ForConditionalGeneration(config).to(torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "mm_input_projection" in name:
                    param.normal_(0.0, 0.5)
                elif "norm" in name:
                    param.add_(torch.randn_like(param) * 0.2)
            model.lm_head.weight.normal_(0.0, LOGIT_STD / hidden**0.5)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def picture(seed: int, size: tuple[int, int] = (40, 30)):
    """A random RGB picture (PIL) of size (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def hf_greedy_vl(model, processor, messages: list[dict], new_tokens: int) -> list[int]:
    """transformers' generate on the processor's own rendering of messages (images as PIL pictures in
    {"type": "image", "image": ...} parts), EOS ignored."""
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            **inputs, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()
