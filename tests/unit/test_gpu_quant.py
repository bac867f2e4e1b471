"""The GPU check's quantized stacks (bench/gpu_quant.py): each format's config.json, loaded with dummy
weights as the lease loads it, gives each linear layer the method and kernel-held weight that format
means, and its product runs (on CPU here: the CPU paths; the GPU check runs the CUDA ones)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.gpu_check import TOY
from bench.gpu_quant import TOY_GROUP, stack_formats
from shard_worker.model.loader import load_model
from shard_worker.model.quant.kernels import PackedInt4
from shard_worker.parallel import TensorParallel


@pytest.mark.parametrize("name", ["dense", "int4", "int8", "fp8"])
def test_each_stack_format_loads_dummy_weights_into_its_method(tmp_path, name):
    quantization = stack_formats(TOY_GROUP)[name]
    config = {**TOY, **({"quantization_config": quantization} if quantization else {})}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, model = load_model(tmp_path, torch.float32, torch.device("cpu"), TensorParallel(), "dummy")
    layers = [m for n, m in model.named_modules() if n.endswith("qkv_proj") or n.endswith("down_proj")]
    assert len(layers) == 2 * TOY["num_hidden_layers"]
    for layer in layers:
        method = type(layer.quant_method).__name__
        if name == "int4":
            assert isinstance(layer.packed, PackedInt4) and layer.packed.group_size == TOY_GROUP
        elif name == "int8":
            assert method == "Int8Method" and not layer.quant_method.w8a8
        elif name == "fp8":
            held = getattr(layer, "cpu_packed", None) is not None  # our CPU kernel's layout, else e4m3
            assert method == "Fp8Method" and (held or layer.weight.dtype == torch.float8_e4m3fn)
            assert layer.quant_method.dynamic_act and layer.quant_method.per_token
        else:
            assert "Unquantized" in method
        x = torch.randn(3, layer.input_size)
        y = layer.quant_method.apply(layer, x)
        assert y.shape == (3, sum(layer.output_sizes)) and torch.isfinite(y).all()
    assert "Unquantized" in type(model.lm_head.quant_method).__name__  # compressed-tensors' ignore list
