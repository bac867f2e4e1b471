"""Small random Qwen2.5-VL and Qwen3-VL checkpoints, built with transformers' classes and saved with
save_pretrained (tests/model_families.py's conventions: peaked logits, randomised norms, untied
embeddings), for the unit tests of the towers and the text models and for the e2e serving test.

The towers are tiny (patch 4, so a 16 x 24 picture is 4 x 6 patches, 2 x 3 merged tokens) and their
windows 2 x 2 merge blocks, so an image of a few blocks a side has several windows, some cut short.
With a tokenizer directory (the tiny test model's), the checkpoint gets a processor too: that tokenizer
with Qwen's markers and turn tokens added, a chat template in Qwen's form (an image part is
<|vision_start|><|image_pad|><|vision_end|>), and Qwen2-VL's image processor at patch 4 with pixel
limits that keep pictures of a few dozen pixels a side near their size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.model_families import LOGIT_STD, SMALL, VOCAB

# Placeholder and frame ids inside the small vocabulary (the real ones are past 151000).
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 250, 251, 248, 249
IDS = dict(
    image_token_id=IMAGE_TOKEN_ID,
    video_token_id=VIDEO_TOKEN_ID,
    vision_start_token_id=VISION_START_ID,
    vision_end_token_id=VISION_END_ID,
)
VISION = dict(
    depth=3,
    hidden_size=32,
    num_heads=2,
    intermediate_size=48,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    in_channels=3,
    initializer_range=0.25,
)
TEXT = {k: v for k, v in SMALL.items() if k not in ("tie_word_embeddings", "head_dim", "vocab_size")}
# head_dim 16: 8 frequencies, split t/h/w.
MROPE_SECTION = [2, 3, 3]


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARKERS = [
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|im_start|>",
    "<|im_end|>",
]
# min and max pixels of a resized picture (the processor keeps the aspect ratio within them).
MIN_PIXELS, MAX_PIXELS = 8 * 8, 48 * 48


def _configs(vocab: int = VOCAB, ids: dict = IDS):
    import transformers as t

    return {
        "qwen2_5_vl": lambda: t.Qwen2_5_VLConfig(
            text_config=dict(
                **TEXT,
                vocab_size=vocab,
                num_hidden_layers=2,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": MROPE_SECTION,
                },
            ),
            vision_config=dict(**VISION, out_hidden_size=64, window_size=16, fullatt_block_indexes=[1]),
            tie_word_embeddings=False,
            **ids,
        ),
        "qwen3_vl": lambda: t.Qwen3VLConfig(
            text_config=dict(
                **TEXT,
                vocab_size=vocab,
                head_dim=16,
                num_hidden_layers=3,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": MROPE_SECTION,
                    "mrope_interleaved": True,
                },
            ),
            vision_config=dict(
                **VISION,
                hidden_act="gelu_pytorch_tanh",
                out_hidden_size=64,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0, 1],
            ),
            tie_word_embeddings=False,
            **ids,
        ),
    }


FAMILIES = tuple(_configs())


def hf_config(family: str, vocab: int = VOCAB, ids: dict = IDS):
    return _configs(vocab, ids)[family]()


def build_checkpoint(
    family: str, out_dir: str | Path, seed: int = 0, tokenizer_dir: str | Path | None = None
) -> Path:
    """Writes a random `family` checkpoint (config.json, generation_config.json, safetensors), and its
    processor's files when given a tokenizer to start from."""
    from transformers import AutoModelForImageTextToText

    out = Path(out_dir)
    vocab, ids = VOCAB, IDS
    if tokenizer_dir is not None:
        tok = _processor_files(out, tokenizer_dir)
        vocab = -(-len(tok) // 16) * 16
        ids = {
            name: tok.convert_tokens_to_ids(token)
            for name, token in zip(
                IDS, ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"), strict=True
            )
        }
    config = hf_config(family, vocab, ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "ln_q" in name:
                    param.add_(torch.randn_like(param) * 0.2)
            model.lm_head.weight.normal_(0.0, LOGIT_STD / config.text_config.hidden_size**0.5)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.save_pretrained(out)
    return out


def _processor_files(out: Path, tokenizer_dir):
    import transformers as t
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = t.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    image_processor.save_pretrained(out)
    return tok


def load_reference(model_dir: str | Path, dtype: torch.dtype = torch.float64):
    """transformers' model (float64 unless told), eval mode."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()


assert VOCAB > IMAGE_TOKEN_ID
