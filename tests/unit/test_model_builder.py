"""The embedded model's tokenizer: loads with AutoTokenizer, matches the model's vocab, round-trips any
text, and is the same on every build."""

from __future__ import annotations

import json

from transformers import AutoConfig, AutoTokenizer

from shard_worker.model.builder import build_tokenizer


def test_tokenizer_round_trips_unicode_and_fills_the_vocab(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    config = AutoConfig.from_pretrained(tiny_model)
    assert len(tok) == config.vocab_size
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert (tok.bos_token_id, tok.eos_token_id) == (config.bos_token_id, config.eos_token_id)
    for text in ["hello world", "  leading and trailing  ", "café 東京 🙂 \x00\t\r\n", "Привет, مرحبا", ""]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert max(ids) < config.vocab_size
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_build_is_deterministic():
    first, second = (json.loads(build_tokenizer(1024, 1024).backend_tokenizer.to_str()) for _ in range(2))
    assert len(first["model"]["vocab"]) + len(first["added_tokens"]) >= 1024
    assert first == second
