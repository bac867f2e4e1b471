"""What is not served is refused at start-up, naming the field: an unknown architecture, and each config
field that would change the maths and is not implemented (the CLI turns the ValueError into one line and
exit 2: tests/e2e/test_model_refusals.py)."""

from __future__ import annotations

import json

import pytest

from shard_worker.model.config import ModelConfig
from shard_worker.model.registry import model_class
from shard_worker.parallel import TensorParallel
from tests.model_families import build_checkpoint

LONGROPE = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
REFUSALS = [
    # (family, config.json change, what the message must name)
    (
        "llama",
        {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"},
        "architecture 'Gemma2ForCausalLM'",
    ),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (
        "phi3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
        "partial_rotary_factor 0.75",
    ),
    (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        "rope_type 'dynamic'",
    ),
    (
        "qwen3",
        {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
        "layer_types 'chunked",
    ),
    ("llama", {"architectures": []}, "no architectures list"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: build_checkpoint(f, tmp_path_factory.mktemp(f)) for f in {r[0] for r in REFUSALS}}


@pytest.mark.parametrize(
    "family, change, names", REFUSALS, ids=[r[2].split()[0].split("=")[0] for r in REFUSALS]
)
def test_refused_with_the_field_named(checkpoints, tmp_path, family, change, names):
    config = json.loads((checkpoints[family] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError) as e:
        ModelConfig.from_pretrained(tmp_path)
    message = str(e.value)
    assert names in message and "\n" not in message
    assert message.startswith(str(tmp_path / "config.json"))


def test_sliding_windows_and_ropes_per_layer(tmp_path):
    # Gemma 3's test checkpoint: two local layers (window, local rope) and a global one (its own rope).
    gemma = build_checkpoint("gemma3", tmp_path)
    config = ModelConfig.from_pretrained(gemma)
    assert config.sliding_windows == (20, 20, None)
    assert config.rotary[0] == config.rotary[1] != config.rotary[2]
    assert config.max_position_embeddings == 512  # no longer capped at the window
    # One rotary module per distinct rope, so a step computes cos/sin twice, not once per layer.
    model = model_class(config.architecture)(config, TensorParallel())
    assert len(model.rotary) == 2 and model.rotary_of_layer == [0, 0, 1]
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [20, 20, None]
