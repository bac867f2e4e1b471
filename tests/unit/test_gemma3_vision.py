"""Gemma 3's image encoder (SigLIP tower + projector, shard_worker/model/gemma3_vision.py) loaded from a
random Gemma3ForConditionalGeneration checkpoint that transformers writes: its soft tokens equal
transformers' get_image_features on the same pixels."""

import pytest
import torch
from safetensors.torch import load_file

from shard_worker.model.gemma3_vision import Gemma3ImageEncoder

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=4,
    )
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the norms start at zero and the projection at zero: make them count
        for name, p in model.named_parameters():
            if "mm_input_projection" in name or "norm" in name:
                p.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("gemma3-vl")
    model.save_pretrained(out)
    return out, model


def test_soft_tokens_equal_transformers(checkpoint):
    path, reference = checkpoint
    torch.set_flush_denormal(True)
    encoder = Gemma3ImageEncoder(reference.config)
    encoder.load(load_file(path / "model.safetensors"))
    encoder = encoder.double()
    reference = reference.double()
    pixels = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        ours = encoder(pixels)
        theirs = reference.get_image_features(pixels).pooler_output
    assert ours.shape == (3, 16, 48)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    # The published checkpoints' names (vision_tower.vision_model.*) load the same weights.
    tensors = load_file(path / "model.safetensors")
    published = {k.replace("vision_tower.", "vision_tower.vision_model."): v for k, v in tensors.items()}
    again = Gemma3ImageEncoder(reference.config)
    again.load(published)
    with torch.no_grad():
        torch.testing.assert_close(again.double()(pixels), ours, rtol=0, atol=0)


def test_a_checkpoint_without_the_encoder_is_refused(checkpoint):
    _, reference = checkpoint
    with pytest.raises(ValueError, match="lacks the image encoder's"):
        Gemma3ImageEncoder(reference.config).load(
            {"model.language_model.embed_tokens.weight": torch.zeros(1)}
        )
