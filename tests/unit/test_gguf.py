"""GGUF: our unpack of each 4-bit type into PackedInt4's (q, scale, zero), and of each int8-kept type into
PackedInt8Groups' (q, scale), against gguf's own dequantization; PackedInt8Groups' products against the
dequantized matmul; the layers each file's types give; refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.gguf_model import model_dir
from shard_worker.model.quant import cpu_linear
from shard_worker.model.quant.gguf import INT8_GROUPS, check_type, unpack_int4, unpack_int8
from shard_worker.model.quant.int8_groups import PackedInt8Groups
from shard_worker.model.quant.kernels import PackedInt4

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402


def _random_blocks(type_name: str, n: int, k: int, rng) -> np.ndarray:
    """Random raw blocks (any bits are a valid block but the float16 scales, drawn finite here), with
    some scales zero (a block of one value), which q, scale, zero must still hold."""
    t = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    halves = 2 if type_name in ("Q4_0", "Q5_0", "Q8_0", "Q6_K") else 4  # d (and m / dmin)
    scales = rng.normal(0, 0.05, (n, k // block, halves // 2)).astype(np.float16)
    scales[0, 0, 0] = 0  # d == 0: the block is its m (Q4_1), or its sub-blocks -dmin mn (Q4_K)
    at = slice(size - 2, size) if type_name == "Q6_K" else slice(0, halves)  # Q6_K's d comes last
    raw[..., at] = scales.view(np.uint8).reshape(n, k // block, halves)
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


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q4_0", "Q6_K"])
def test_int8_unpack_equals_gguf_dequantize_exactly(type_name):
    n, k, g = 48, 512, INT8_GROUPS[type_name]
    raw = _random_blocks(type_name, n, k, np.random.default_rng(0))
    expected = dequantize(raw, gguf.GGMLQuantizationType[type_name])
    q, scale = unpack_int8(type_name, raw, (n, k))
    assert q.dtype == np.int8 and scale.shape == (n, k // g)
    packed = PackedInt8Groups.pack(torch.from_numpy(q), torch.from_numpy(scale), g)
    np.testing.assert_array_equal(packed.dequantize(torch.float32).numpy(), expected)
    halves = "cpu_linear int4" if cpu_linear.available_int4() else "weight_int4pack_mm_for_cpu"
    assert packed.kernel == ("compiled" if type_name == "Q6_K" else f"{halves}, K doubled")


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_groups_product_equals_dequantized_matmul(group, rows):
    """Each kernel (two 4-bit tinygemm products at group 32; the compiled ones at 16, one row or more)
    against x times the dequantized weight in float64: bf16's rounding of x (and of the split's scales)
    is the only difference, as for every CPU kernel here; float64 runs the dequantized weight exactly."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 48, 256
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.01).half().float()  # fp16 scales, as GGUF
    packed = PackedInt8Groups.pack(q, scale, group)
    w = (q.double().view(n, k // group, group) * scale.double()[..., None]).view(n, k)
    torch.testing.assert_close(packed.dequantize(torch.float64), w, rtol=0, atol=0)
    x = torch.randn(2, rows, k, generator=gen)
    expected = x.double() @ w.T
    torch.testing.assert_close(packed.matmul(x.double()), expected, rtol=1e-12, atol=1e-12)
    for dtype in (torch.float32, torch.bfloat16):
        y = packed.matmul(x.to(dtype))
        assert y.dtype == dtype and y.shape == (2, rows, n)
        err = (y.double() - expected).abs().max() / expected.abs().max()
        assert err < 1e-2, (dtype, float(err))
    if rows == 1 and group == 16:  # the fused one-row product stays in float32: far tighter
        torch.testing.assert_close(packed.matmul(x[0]).double(), expected[0], rtol=1e-5, atol=1e-5)
    unpacked_q, unpacked_scale = packed.unpack()
    assert torch.equal(unpacked_q, q) and torch.equal(unpacked_scale, scale)


def test_q4_0_from_ggufs_quantizer_round_trips_exactly():
    w = np.random.default_rng(1).normal(0, 1, (16, 64)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType.Q4_0)
    q, scale, zero = unpack_int4("Q4_0", raw, w.shape)
    ours = (q.astype(np.float32) - zero.repeat(32, 1)) * scale.repeat(32, 1)
    np.testing.assert_array_equal(ours, dequantize(raw, gguf.GGMLQuantizationType.Q4_0))


def test_unsupported_type_is_one_line():
    check_type("blk.0.attn_q.weight", "Q8_0")  # kept as int8: accepted
    check_type("blk.0.attn_q.weight", "Q5_K")  # dequantized at load: accepted
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


def test_a_tensor_that_maps_to_no_parameter_is_an_error(tiny_model, tmp_path):
    """Every tensor of the file is read: one the model has no parameter for (here: dropped from the
    name table) stops the load, quantized or not, rather than being skipped."""
    from transformers import AutoConfig

    from shard_worker.model.quant.gguf import GGUFConfig, gguf_tensors, hf_names
    from tests.gguf_files import write_tiny_gguf

    file = write_tiny_gguf(tiny_model, tmp_path / "tiny.gguf")
    quant = GGUFConfig(None, str(file))
    mapping, processor = hf_names(quant, AutoConfig.from_pretrained(tiny_model))
    assert len(list(gguf_tensors(quant, mapping, processor, torch.float32, {}))) == len(quant.reader.tensors)
    for dropped in ("blk.1.ffn_down.weight", "blk.0.attn_norm.weight"):  # Q8_0, F32
        partial = {k: v for k, v in mapping.items() if k != dropped}
        with pytest.raises(ValueError, match=f"tensor {dropped} maps to no parameter"):
            list(gguf_tensors(quant, partial, processor, torch.float32, {}))


@pytest.mark.skipif(
    not cpu_linear.available(torch.int8), reason="the embedding is dequantized without the kernel"
)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "own_head"])
def test_a_q8_0_embedding_stays_int8_and_a_tied_head_multiplies_by_it(tiny_model, tmp_path, monkeypatch, tie):
    """token_embd Q8_0 (SmolLM2's and Gemma 3's packaged files): held in our int8 kernel's layout, rows
    read from it, and a tied LM head multiplies by it; the logits equal the file's weights dequantized
    (gguf's own dequantization, saved as a float32 checkpoint) up to x's rounding to bf16 in the head."""
    from shard_worker.model.loader import load_model
    from shard_worker.model.quant.gguf import GGUFEmbeddingMethod, TiedInt8HeadMethod
    from shard_worker.parallel import TensorParallel
    from tests.gguf_files import write_tiny_gguf, write_wide_llama

    monkeypatch.setenv("TPSERVE_CACHE", str(tmp_path / "cache"))
    wide = write_wide_llama(tiny_model, tmp_path / "wide", tie=tie)
    types = {"embed_tokens": "Q8_0", "lm_head": "F32"}
    file = write_tiny_gguf(wide, tmp_path / "wide.gguf", types, reference_dir=tmp_path / "reference")
    cpu, tp = torch.device("cpu"), TensorParallel()
    _, model = load_model(model_dir(str(file)), torch.float32, cpu, tp)
    _, reference = load_model(tmp_path / "reference", torch.float32, cpu, tp, prepack_linear=False)
    embedding = model.model.embed_tokens
    assert isinstance(embedding.quant_method, GGUFEmbeddingMethod) and embedding.cpu_packed.group == 32
    assert embedding.weight.dtype == torch.int8  # the layout, not a float copy
    assert isinstance(model.lm_head.quant_method, TiedInt8HeadMethod) == tie
    ids = torch.tensor([0, 5, 17, 100, embedding.vocab_size - 1])
    torch.testing.assert_close(embedding(ids), reference.model.embed_tokens(ids), rtol=0, atol=0)
    hidden = torch.randn(3, 256)
    want = reference.lm_head(hidden)
    rounded = reference.lm_head(hidden.bfloat16().float()) if tie and cpu_linear.int8_rounds_x() else want
    torch.testing.assert_close(model.lm_head(hidden), rounded, rtol=1e-5, atol=1e-5)
