"""The second real checkpoint, models/gemma3 (Gemma 3 270M, the base model, built by `make model
PRESET=gemma3`): its facts, and our ModelRunner's greedy completions equal to transformers' generate on
the same directory, token for token, in float32, one prompt long enough (over 512 tokens) that its local
layers' sliding window cuts off the start. Skipped when the model is not built; TPSERVE_TEST_GEMMA3 points
the test at a directory built elsewhere."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shard_worker.model import builder as model_builder
from shard_worker.model.config import ModelConfig
from shard_worker.model.packaged import SOURCE_FILE
from tests.unit.greedy import hf_greedy, new_runner, runner_greedy

torch.set_flush_denormal(True)

GEMMA3 = Path(
    os.environ.get("TPSERVE_TEST_GEMMA3") or Path(__file__).resolve().parents[2] / "models" / "gemma3"
)
NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    # About 600 tokens: past the 512-token window of the local layers.
    "Here is a list of the numbers from one to two hundred: "
    + ", ".join(str(i) for i in range(1, 201))
    + ". And here are the first ten letters of the alphabet:",
]

needs_gemma3 = pytest.mark.skipif(
    not (GEMMA3 / SOURCE_FILE).is_file(),
    reason="models/gemma3 is not built (`make model PRESET=gemma3` builds it: a 240 MB download)",
)


@needs_gemma3
def test_gemma3_is_the_270m_base_model():
    config = ModelConfig.from_pretrained(GEMMA3)
    assert config.architecture == "Gemma3ForCausalLM" and config.tie_word_embeddings
    # Five local layers (window 512, rope base 10k) to one global (rope base 1M), as Gemma 3 has them.
    assert config.sliding_windows == ((512,) * 5 + (None,)) * 3
    assert config.rotary[0] != config.rotary[5]
    tokenizer = AutoTokenizer.from_pretrained(GEMMA3)
    assert not tokenizer.chat_template  # a base model: completions only
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("<eos>", "<end_of_turn>")} <= set(
        config.eos_token_ids
    )
    assert json.loads((GEMMA3 / SOURCE_FILE).read_text())["sha256"] == model_builder.GEMMA3.sha256
    assert (GEMMA3 / "GEMMA_TERMS.html").is_file()


@needs_gemma3
def test_gemma3_greedy_matches_transformers(one_thread):
    tokenizer = AutoTokenizer.from_pretrained(GEMMA3)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len(prompts[-1]) > 512
    got = runner_greedy(new_runner(GEMMA3, torch.float32), prompts, NEW_TOKENS)
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(GEMMA3, dtype=torch.float32), prompts, NEW_TOKENS)
    for prompt, ours, theirs in zip(PROMPTS, got, want, strict=True):
        assert ours == theirs, f"{prompt[:40]!r}: {tokenizer.decode(ours)!r} != {tokenizer.decode(theirs)!r}"
    # A base model, and a small one: it continues with "the capital of the country of France. It is the
    # largest city in France ...", not "Paris". Still, words about France, not noise.
    assert "France" in tokenizer.decode(got[0])
