"""Quantized checkpoints and online quantization on the ModelRunner: each compressed-tensors scheme,
written by compressed-tensors itself, gives the logits (and greedy tokens) of transformers running the
same model with its weights dequantized by an independent routine (and the scheme's dynamic activation
rounding as hooks); --quantization int8 / fp8 give what the same model quantized offline by the same
rule gives; and the loader reads every tensor of each format, none unread, none missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from tests.quant_checkpoints import (
    SCHEMES,
    activation_rounding,
    build_compressed,
    build_unquantized,
    dequantized_copy,
    offline_quantized,
)
from tests.unit.test_model_runner import BLOCK_SIZE, BlockPool, Seq, forward_logits, plan

torch.set_flush_denormal(True)
IDS = [0] + [(131 + i * 97) % 1000 + 2 for i in range(40)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(scheme: str) -> Path:
        if scheme not in made:
            made[scheme] = build_compressed(scheme, tmp_path_factory.mktemp(scheme))
        return made[scheme]

    return get


def runner(model_dir: Path, quantization: str | None = None, dtype=torch.float32) -> ModelRunner:
    r = ModelRunner(model_dir, dtype, torch.device("cpu"), TensorParallel(), quantization=quantization)
    r.allocate_kv_cache(16, BLOCK_SIZE)
    return r


def our_logits(r: ModelRunner) -> torch.Tensor:
    return forward_logits(r, plan(BlockPool(16), [(Seq(0, IDS, len(IDS)), len(IDS))]))


def hf_logits(model_dir: Path, prepare=None, dtype=torch.float32) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if prepare is not None:
        prepare(model)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def assert_same_predictions(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_gives_transformers_logits_on_the_dequantized_weights(
    scheme, checkpoints, tmp_path
):
    model = checkpoints(scheme)
    # Compared in float64, where our products are the dequantized weight's (quant/products.py) and
    # transformers' the same: exact but for summation order. Rounding activations (W8A8) would make a
    # last-bit difference a whole quantum in float32. The CPU kernels (float32 / bfloat16) round
    # activations to bfloat16 (quant/kernels.py): checked below against the same float64 logits.
    want = hf_logits(
        dequantized_copy(model, tmp_path / "dequantized"), activation_rounding(model), torch.float64
    )
    r = runner(model, dtype=torch.float64)
    # The layers hold their on-disk form's kernel layout, not float weights.
    qkv = r.model.model.layers[0].self_attn.qkv_proj
    assert not (hasattr(qkv, "weight") and qkv.weight.dtype == torch.float64)
    assert r.model.lm_head.weight.dtype == torch.float64  # in the ignore list
    assert_same_predictions(our_logits(r), want, atol=1e-4)
    if SCHEMES[scheme][1] is None:  # weight-only: the kernels' path
        assert_close_to_bf16_activations(our_logits(runner(model)), want)


def assert_close_to_bf16_activations(got: torch.Tensor, want: torch.Tensor) -> None:
    """Logits from the CPU kernels (activations rounded to bfloat16, 2^-9 relative per product input,
    through two layers) against exact ones: within 1.0 (0.35 measured on these peaked logits, std 4),
    and the same prediction at 90% of positions (near-ties may flip); a wrong layout or zero point
    moves logits by several units and predictions at most positions."""
    assert (got.double() - want).abs().max() < 1.0
    assert (got.argmax(-1) == want.argmax(-1)).double().mean() >= 0.9


def test_a_missing_or_an_extra_tensor_is_named(checkpoints, tmp_path):
    model = checkpoints("w4a16_asym")
    tensors = load_file(model / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model / name, tmp_path / name)
    victim = "model.layers.1.self_attn.k_proj.weight_zero_point"
    save_file({n: t for n, t in tensors.items() if n != victim}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"has no tensor {victim}"):
        runner(tmp_path)
    extra = {**tensors, "model.layers.0.mlp.up_proj.input_scale": torch.ones(1)}
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="input_scale matches no parameter"):
        runner(tmp_path)


@pytest.mark.parametrize("rule", ["int8", "fp8"])
def test_online_quantization_equals_the_model_quantized_offline_by_the_same_rule(rule, tmp_path):
    model = build_unquantized(tmp_path / "model")
    # float64: the quantized products are the dequantized weights' there (float32 ones run the CPU
    # kernels, which round activations to bfloat16: checked loosely below).
    want = our_logits(runner(offline_quantized(model, tmp_path / "offline", rule), dtype=torch.float64))
    r = runner(model, quantization=rule, dtype=torch.float64)
    qkv = r.model.model.layers[0].self_attn.qkv_proj
    held = dict(qkv.named_parameters()).get("weight")  # int8 in our CPU kernel's layout, or none
    assert held is None or held.dtype == torch.int8  # no full-precision copy kept
    assert r.model.lm_head.weight.dtype == torch.float64
    got = our_logits(r)
    assert_same_predictions(got, want, atol=1e-4)
    # ... which is not the unquantized model's.
    assert (got - our_logits(runner(model, dtype=torch.float64))).abs().max() > 1e-3
    if rule == "int8":
        assert_close_to_bf16_activations(our_logits(runner(model, quantization=rule)), want)


def test_online_quantization_of_an_already_quantized_checkpoint_is_refused(checkpoints):
    with pytest.raises(ValueError, match="--quantization int8: the checkpoint is already quantized"):
        runner(checkpoints("w8a16"), quantization="int8")


def test_refused_schemes_name_what_is_refused(checkpoints, tmp_path):
    model = checkpoints("w8a16")
    config = json.loads((model / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(model / name, tmp_path / name)
    group = config["quantization_config"]["config_groups"]["group_0"]
    cases = [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"config_groups": {"g": {**group, "format": "marlin-24"}}}, "format 'marlin-24' is not supported"),
        ({"config_groups": {"g": {**group, "weights": {**group["weights"], "num_bits": 3}}}}, "int3 weights"),
        (
            {"config_groups": {"g": {**group, "input_activations": {"num_bits": 8, "dynamic": False}}}},
            "static are not supported",
        ),
        ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme is not supported"),
    ]
    for change, message in cases:
        qc = {**config["quantization_config"], **change}
        (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(ValueError, match=message) as e:
            runner(tmp_path)
        assert "\n" not in str(e.value) and str(tmp_path / "config.json") in str(e.value)
