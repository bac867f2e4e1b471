"""GGUF: our unpack of each 4-bit type into PackedInt4's (q, scale, zero) against gguf's own
dequantization; the layers each file's types give; refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.gguf_model import model_dir
from shard_worker.model.quant.gguf import check_type, unpack_int4
from shard_worker.model.quant.kernels import PackedInt4

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402


def _random_blocks(type_name: str, n: int, k: int, rng) -> np.ndarray:
    """Random raw blocks (any bits are a valid block but the float16 scales, drawn finite here), with
    some scales zero (a block of one value), which q, scale, zero must still hold."""
    t = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    halves = 2 if type_name == "Q4_0" else 4  # d (and m / dmin) at the block's start
    scales = rng.normal(0, 0.05, (n, k // block, halves // 2)).astype(np.float16)
    scales[0, 0, 0] = 0  # d == 0: the block is its m (Q4_1), or its sub-blocks -dmin mn (Q4_K)
    raw[..., :halves] = scales.view(np.uint8).reshape(n, k // block, halves)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_unpack_equals_gguf_dequantize(type_name):
    rng = np.random.default_rng(0)
    n, k = 48, 512
    raw = _random_blocks(type_name, n, k, rng)
    expected = dequantize(raw, gguf.GGMLQuantizationType[type_name])
    q, scale, zero = unpack_int4(type_name, raw, (n, k))
    assert q.dtype == np.uint8 and q.max() <= 15 and q.shape == (n, k)
    packed = PackedInt4.pack(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero), 32)
    ours = packed.dequantize(torch.float32).numpy()
    if type_name == "Q4_0":
        np.testing.assert_array_equal(ours, expected)  # d (q - 8): the same float32 arithmetic
    else:  # (q - zero) scale with zero = -m / d rounds differently from d q + m: float32 ulps
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-7 * float(np.abs(expected).max()))
    np.testing.assert_array_equal(ours[0, :32], expected[0, :32])  # the zero-scale block: exact
    assert not np.all(expected[0, :32] == 0) or type_name == "Q4_0"  # (a constant, not zeros)


def test_q4_0_from_ggufs_quantizer_round_trips_exactly():
    w = np.random.default_rng(1).normal(0, 1, (16, 64)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType.Q4_0)
    q, scale, zero = unpack_int4("Q4_0", raw, w.shape)
    ours = (q.astype(np.float32) - zero.repeat(32, 1)) * scale.repeat(32, 1)
    np.testing.assert_array_equal(ours, dequantize(raw, gguf.GGMLQuantizationType.Q4_0))


def test_unsupported_type_is_one_line():
    check_type("blk.0.attn_q.weight", "Q8_0")  # dequantized at load: accepted
    with pytest.raises(ValueError, match="blk.0.attn_q.weight has type IQ2_XXS, which is not supported"):
        check_type("blk.0.attn_q.weight", "IQ2_XXS")


def test_model_dir_refusals(tmp_path):
    assert model_dir(str(tmp_path)) == str(tmp_path)  # a directory is itself
    with pytest.raises(ValueError, match="only for a GGUF --model"):
        model_dir(str(tmp_path), tokenizer=str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        model_dir(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("own_tokenizer", [True, False])
def test_model_dir_of_a_gguf_file(tiny_model, tmp_path, monkeypatch, own_tokenizer):
    """config.json from the file's metadata (+ the gguf quantization_config), the tokenizer from the
    file or --tokenizer; the directory is reused for the same file."""
    import json

    from transformers import AutoTokenizer

    from tests.gguf_files import write_tiny_gguf

    monkeypatch.setenv("TPSERVE_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tiny_model, tmp_path / "tiny.gguf")
    tokenizer = None if own_tokenizer else str(tiny_model)
    out = model_dir(str(file), tokenizer)
    assert out.endswith("/tiny") and model_dir(str(file), tokenizer) == out
    config, original = (json.loads((p / "config.json").read_text()) for p in (Path(out), tiny_model))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["quantization_config"] == {"quant_method": "gguf", "file": str(file.resolve())}
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size", "eos_token_id"):
        assert config[key] == original[key], key
    text = "The quick brown fox, café 東京 42."
    theirs = AutoTokenizer.from_pretrained(tiny_model)(text).input_ids
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == theirs
    assert model_dir(out, str(tiny_model)) == out  # launch passes --tokenizer on with the directory
