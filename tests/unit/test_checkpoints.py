"""What real Hugging Face checkpoints carry and our random models did not, each loaded through ModelRunner
and decoded greedily against transformers' generate in float64: weights sharded over several files with an
index (and a stray file beside them), bf16 on disk, tied embeddings (no lm_head.weight in the file), Llama 3
rope scaling written the way Llama 3.x's config.json writes it, head_dim given explicitly, and several EOS
ids in generation_config.json."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from tests.unit.greedy import hf_greedy, new_runner, runner_greedy

torch.set_flush_denormal(True)

VOCAB = 320
NEW_TOKENS = 10
# Llama 3.1's rope scaling, with original_max_position_embeddings small so that the prompts below reach
# positions where the scaled (low) frequencies differ from the unscaled ones.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FEATURES = ("sharded_bf16", "tied", "llama3_rope", "head_dim", "eos_list")


def save_checkpoint(path, features: set[str]) -> None:
    """A tiny random Llama with the given features, written as save_pretrained writes it."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # 16, not hidden_size / heads = 12: q/k/v/o shapes and the attention scale all follow head_dim.
        head_dim=16 if "head_dim" in features else None,
        max_position_embeddings=256,
        initializer_range=0.2,  # peaked next-token distributions, so greedy is not decided by near-ties
        tie_word_embeddings="tied" in features,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        eos_token_id=3,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if "eos_list" in features:
        model.generation_config = GenerationConfig(eos_token_id=[3, 7, 11])
    if "sharded_bf16" in features:
        model.to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
        # A file no index names (some repositories ship consolidated.safetensors beside the shards): the
        # loader must not read it.
        save_file({"stray.weight": torch.zeros(2)}, path / "consolidated.safetensors")
    else:
        model.save_pretrained(path)
    if "llama3_rope" in features:
        # As Llama 3.x's own config.json has it: rope_theta at the top and the scaling in rope_scaling
        # (transformers 5 writes rope_parameters; checkpoints on the hub still carry the old fields).
        cfg = json.loads((path / "config.json").read_text())
        theta = cfg.pop("rope_parameters")["rope_theta"]
        cfg.update(rope_theta=theta, rope_scaling=LLAMA3_ROPE)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))


def prompts() -> list[list[int]]:
    # 70 tokens reach past original_max_position_embeddings (32); the others are short.
    return [[(7 * i + 3 * n) % (VOCAB - 20) + 20 for i in range(n)] for n in (70, 5, 17)]


@pytest.mark.parametrize("features", [*[(f,) for f in FEATURES], FEATURES], ids=[*FEATURES, "all"])
def test_checkpoint_feature_decodes_like_transformers(tmp_path, features):
    save_checkpoint(tmp_path, set(features))
    files = {p.name for p in tmp_path.glob("*.safetensors")}
    if "sharded_bf16" in features:
        assert (tmp_path / "model.safetensors.index.json").exists() and len(files) > 3
    if "tied" in features:
        for name in files - {"consolidated.safetensors"}:
            with safe_open(tmp_path / name, "pt") as f:
                assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (not iterable)

    runner = new_runner(tmp_path, torch.float64)
    eos = runner.describe()["eos_token_ids"]
    assert eos == ([3, 7, 11] if "eos_list" in features else [3])
    if "head_dim" in features:
        assert runner.config.head_dim == 16
    reference = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    if "llama3_rope" in features:
        assert reference.config.rope_parameters["rope_type"] == "llama3"
        inv_freq = torch.tensor(runner.config.rotary[0].inv_freq, dtype=torch.float64)
        torch.testing.assert_close(inv_freq, reference.model.rotary_emb.inv_freq.double())

    got = runner_greedy(runner, prompts(), NEW_TOKENS)
    assert got == hf_greedy(reference, prompts(), NEW_TOKENS)


def test_index_naming_a_missing_file_is_an_error(tmp_path):
    save_checkpoint(tmp_path, {"sharded_bf16"})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(ValueError, match=victim):
        new_runner(tmp_path, torch.float32)
