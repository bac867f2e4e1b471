"""FP8 on CUDA through torch._scaled_mm (quant/products.py), tested on CPU: torch's CPU build runs the same
call (its reference fp8 GEMM, with the same checks of scale shapes: rowwise [M, 1] and [1, N], or one
scalar each), so the exact call a Hopper runs is run here against a float64 product of the quantized
operands; which devices take it is a function of the device type and compute capability."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shard_worker.model.quant import products
from shard_worker.model.quant.compressed_tensors import Fp8Method

FP8 = torch.float8_e4m3fn


def _weight(n=48, k=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]  # rows of very different sizes
    return products.quantize_fp8(w, per_channel=True)


def _rows(m, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]  # tokens too


def _reference(x, q, scale, x_scale=None):
    """float64: x rounded to e4m3 by its own row's absmax / 448 (or x_scale), times q * scale."""
    x = x.double()
    sx = x.abs().amax(-1, keepdim=True) / 448 if x_scale is None else torch.tensor(float(x_scale)).double()
    xq = (x / sx).clamp(-448, 448).to(FP8).double() * sx
    return xq @ (q.double() * scale.double()[:, None]).t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_scaled_mm_call_matches_the_quantized_product(dtype, m):
    q, scale = _weight()
    x = _rows(m, 64).to(dtype)
    got = products.fp8_scaled_mm(x, q, scale, None)
    want = _reference(x, q, scale)
    assert got.dtype == dtype and got.shape == (m, 48)
    # Per row (the rows' scales differ by 1e5): the bfloat16 output's rounding, 2^-8 of each row's size.
    err = ((got.double() - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    assert err < 8e-3, err


def test_scaled_mm_per_tensor_activations_and_bias():
    q, scale = _weight(seed=2)
    x = _rows(5, 64, seed=3).to(torch.bfloat16).reshape(5, 1, 64)  # [..., K] shapes pass through
    x_scale = x.float().abs().amax() / 448
    bias = torch.randn(48).to(torch.bfloat16)
    got = products.fp8_scaled_mm(x, q, scale, bias, x_scale=x_scale)
    want = _reference(x.reshape(5, 64), q, scale, x_scale) + bias.double()
    assert got.shape == (5, 1, 48)
    assert ((got.reshape(5, 48).double() - want).abs().max() / want.abs().max()).item() < 8e-3
    # One scale for all rows is not the per-token rule: the small rows lose their precision.
    per_token = products.fp8_scaled_mm(x, q, scale, bias)
    assert not torch.equal(per_token, got)


def test_only_cuda_with_fp8_tensor_cores_and_16_aligned_shapes_take_it():
    serves = products.scaled_mm_serves
    assert (
        serves("cuda", (9, 0), 4096, 4096)
        and serves("cuda", (8, 9), 16, 32)
        and serves("cuda", (10, 0), 64, 64)
    )
    assert not serves("cuda", (8, 0), 4096, 4096)  # A100: no fp8
    assert not serves("cuda", (8, 6), 4096, 4096)
    assert not serves("cuda", (9, 0), 4104, 4096) and not serves("cuda", (9, 0), 4096, 4100)
    assert not serves("cpu", None, 4096, 4096)


def test_fp8_linear_routes_by_device(monkeypatch):
    q, scale = _weight(seed=4)
    x = _rows(3, 64, seed=5).to(torch.bfloat16)
    # CPU: unchanged, the dequantized weight in x's dtype.
    assert torch.equal(
        products.fp8_linear(x, q, scale, None, False), F.linear(x, products.dequantize(q, scale, x.dtype))
    )
    # Where the device takes it (CPU standing in for a Hopper here): the _scaled_mm call, activations per
    # token even for a weight-only layer, as vLLM's online fp8.
    monkeypatch.setattr(products, "scaled_mm_serves", lambda device, capability, n, k: True)
    assert torch.equal(
        products.fp8_linear(x, q, scale, None, False), products.fp8_scaled_mm(x, q, scale, None)
    )


@pytest.mark.parametrize("on_cuda", [False, True])
def test_per_tensor_checkpoint_activations_take_one_scale(monkeypatch, on_cuda):
    """compressed-tensors FP8 with per-tensor dynamic activations: one scale for the step, on either path."""
    q, scale = _weight(seed=6)
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = torch.nn.Parameter(q, requires_grad=False), torch.nn.Parameter(scale)
    x = _rows(4, 64, seed=7).to(torch.bfloat16)
    x_scale = x.abs().amax().float().clamp(min=1e-12) / 448
    if on_cuda:
        monkeypatch.setattr(products, "scaled_mm_serves", lambda device, capability, n, k: True)
        want = products.fp8_scaled_mm(x, q, scale, None, x_scale=x_scale)
    else:  # the rule as it was before the CUDA path: x rounded by the one scale, then the dequantized product
        xq = ((x.float() / x_scale).clamp(-448, 448).to(FP8).float() * x_scale).to(x.dtype)
        want = F.linear(xq, products.dequantize(q, scale, x.dtype))
    got = Fp8Method(per_tensor=False, dynamic_act=True, per_token=False).apply(layer, x)
    assert torch.equal(got, want)
