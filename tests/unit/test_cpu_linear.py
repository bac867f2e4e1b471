"""The CPU linear kernel (shard_worker/model/quant/cpu_linear.py, csrc/cpu_linear.cpp) against a float64
product of the same rounded inputs, on every path this machine can run: the native build (AVX-512 BF16
and AVX-512F here), the build without AVX-512 (`avx2`: the AVX2 + FMA float32 path, the bf16 layout in
plain loops) and the one without AVX (`scalar`); odd shapes, 1..40 input rows, both dtypes, bias. And its
seat in the unquantized linear method: repacked at load, oneDNN's packing where the kernel is not there.

Tolerance: float32 sums of K products in any order are within K * 2^-24 * sum_k |x_k w_k| of the exact
sum (the standard bound; 2x here for the fused pair products' own rounding), plus, for a bfloat16
weight, the product's rounding to bfloat16 (2^-8 of it), and for a bfloat16 output its rounding (2^-8 of
the value)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from shard_worker.model.layers.linear import ColumnParallelLinear
from shard_worker.model.quant import cpu_linear
from shard_worker.model.quant.base import replace_param, weight_bytes
from shard_worker.model.quant.unquantized import UnquantizedLinearMethod
from shard_worker.parallel import TensorParallel

X86 = platform.machine() in ("x86_64", "AMD64")


def _cpu_has(*flags: str) -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((x for x in text.splitlines() if x.startswith("flags")), "").split()
    return all(f in line for f in flags)


VARIANTS = [
    "native",
    pytest.param("avx2", marks=pytest.mark.skipif(not (X86 and _cpu_has("avx2", "fma")), reason="no AVX2")),
    pytest.param("scalar", marks=pytest.mark.skipif(not X86, reason="x86 flag set")),
]
SHAPES = [(17, 33), (48, 64), (100, 31), (200, 2100)]  # (N, K): odd K, N off the blocks, K in pieces
ROWS = [1, 3, 7, 8, 9, 16, 31, 50]  # one pass, chunks of 6, two row groups of 48


def _check(y: torch.Tensor, x, w, bias) -> None:
    xr = (x.to(w.dtype) if w.dtype == torch.bfloat16 else x).double()
    wd = w.double()
    product = xr @ wd.T
    want = product + (0 if bias is None else bias.double())
    bound = 2 * w.shape[1] * 2**-24 * (xr.abs() @ wd.abs().T)
    if w.dtype == torch.bfloat16:  # the product in bf16 (then the bias, in y's type)
        bound = bound + 2**-8 * product.abs()
    if y.dtype == torch.bfloat16:
        bound = bound + 2**-8 * want.abs()
    excess = (y.double() - want).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["bf16_w", "f32_w"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16_x", "f32_x"])
def test_products_match_float64_within_float32_summation(variant, w_dtype, x_dtype):
    if cpu_linear.EXT.unavailable(variant) is not None:
        pytest.skip(cpu_linear.EXT.unavailable(variant))
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(w_dtype)
        packed = cpu_linear.PackedLinear.pack(w, variant)
        assert torch.equal(packed.unpack(), w)
        for i, m in enumerate(ROWS):
            x = torch.randn(m, k, generator=gen).to(x_dtype)
            bias = None if i % 3 == 0 else torch.randn(n, generator=gen).to((x_dtype, torch.float32)[i % 2])
            y = cpu_linear.linear(x, packed, bias)
            assert y.dtype == x_dtype and y.shape == (m, n)
            _check(y, x, w, bias)


def test_leading_dimensions_and_a_strided_input_are_taken():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=gen).bfloat16()
    packed = cpu_linear.PackedLinear.pack(w)
    x = torch.randn(2, 3, 48, generator=gen).bfloat16()[..., ::2]  # [2, 3, 24], not contiguous
    y = cpu_linear.linear(x, packed)
    assert y.shape == (2, 3, 40)
    _check(y.reshape(6, 40), x.reshape(6, 24), w, None)
    with pytest.raises(ValueError, match="against a packed"):
        cpu_linear.linear(torch.randn(2, 25), packed)


def test_threads_split_the_work_without_changing_a_bit():
    """Each output's sum runs in the same order whichever thread computes it."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=gen).bfloat16()
    packed = cpu_linear.PackedLinear.pack(w)
    x = torch.randn(100, 200, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.linear(x, packed)
        torch.set_num_threads(2)
        two = cpu_linear.linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def _layer(weight: torch.Tensor, bias: torch.Tensor | None, method) -> ColumnParallelLinear:
    """A loaded layer as the loader leaves it: weight and bias filled in their dtype, then processed."""
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], TensorParallel(), bias=bias is not None)
    layer.quant_method = method
    replace_param(layer, "weight", weight.clone())
    if bias is not None:
        replace_param(layer, "bias", bias.clone())
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_unquantized_method_repacks_for_the_kernel(dtype):
    if not cpu_linear.available(dtype):
        pytest.skip(f"this CPU runs {dtype} weights through oneDNN")
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(70, 36, generator=gen).to(dtype), torch.randn(70, generator=gen).to(dtype)
    layer = _layer(w, b, UnquantizedLinearMethod(prepack=True))
    assert isinstance(layer.cpu_packed, cpu_linear.PackedLinear)
    assert layer.weight.data_ptr() == layer.cpu_packed.data.data_ptr()  # the parameter holds the layout
    rows = cpu_linear.library().tp_linear_rows(cpu_linear.CODES[dtype])  # 16 rows a block; float32 AVX2: 8
    padded = -(-70 // rows) * rows  # 80 in 5 blocks of 16, 72 in 9 of 8
    assert weight_bytes(layer) == padded * 36 * w.element_size() + b.numel() * b.element_size()
    x = torch.randn(3, 36, generator=gen).to(dtype)
    _check(layer(x), x, w, b)
    assert layer(x.double()).dtype == torch.float64  # another dtype: the weight unpacked, F.linear


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_without_the_kernel_weights_are_prepacked_for_onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available", lambda dtype: False)
    w = torch.randn(32, 16)
    layer = _layer(w, None, UnquantizedLinearMethod(prepack=True))
    assert layer.weight.is_mkldnn and getattr(layer, "cpu_packed", None) is None
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), x @ w.T)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_prompt_rows_of_bf16_go_to_onednn_on_an_amx_cpu_within_the_same_bound(monkeypatch, amx):
    """From AMX_ONEDNN_ROWS rows a bfloat16 product goes to oneDNN where the CPU has AMX (forced here, so
    every machine runs the route): the same result within the same bound, bias of either dtype, and
    fewer rows or a float32 x stay on the kernel."""
    monkeypatch.setattr(cpu_linear, "amx_bf16", lambda: amx)
    calls = []
    real = cpu_linear.F.linear
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(72, 40, generator=gen).bfloat16()
    packed = cpu_linear.PackedLinear.pack(w)
    rows = cpu_linear.AMX_ONEDNN_ROWS
    for m, x_dtype, bias_dtype in [
        (rows - 1, torch.bfloat16, None),
        (rows, torch.bfloat16, None),
        (rows + 5, torch.bfloat16, torch.bfloat16),
        (2 * rows, torch.bfloat16, torch.float32),
        (2 * rows, torch.float32, None),
    ]:
        x = torch.randn(m, 40, generator=gen).to(x_dtype)
        bias = None if bias_dtype is None else torch.randn(72, generator=gen).to(bias_dtype)
        y = cpu_linear.linear(x.view(m, 1, 40), packed, bias)
        assert y.dtype == x_dtype and y.shape == (m, 1, 72)
        _check(y.view(m, 72), x, w, bias)
    assert calls == ([rows, rows + 5, 2 * rows] if amx else [])


@pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN has no bfloat16 products on this CPU",
)
def test_both_layouts_send_the_larger_products_to_onednn_and_count_the_copy(monkeypatch):
    """With both layouts (an AMX CPU, the copy fitting) a bfloat16 layer keeps our kernel's layout for
    fewer rows and oneDNN's from ONEDNN_ROWS: each product within the kernel's bound, the copy counted in
    weight_bytes."""
    from shard_worker.model.quant import unquantized

    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(48, 40, generator=gen).bfloat16(), torch.randn(48, generator=gen).bfloat16()
    method = UnquantizedLinearMethod(prepack=True)
    method.both_layouts = True
    layer = _layer(w, b, method)
    plain = _layer(w, b, UnquantizedLinearMethod(prepack=True))
    assert layer.onednn_weight.is_mkldnn and not hasattr(plain, "onednn_weight")
    assert weight_bytes(layer) == weight_bytes(plain) + w.numel() * 2
    kernel_rows = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda x, *a: kernel_rows.append(len(x)) or real(x, *a))
    for m in (1, unquantized.ONEDNN_ROWS - 1, unquantized.ONEDNN_ROWS, 33):
        x = torch.randn(m, 40, generator=gen).bfloat16()
        _check(layer(x), x, w, b)
    assert kernel_rows == [1, unquantized.ONEDNN_ROWS - 1]


def test_both_layouts_only_on_amx_and_within_the_share_of_available_memory(monkeypatch, tmp_path):
    from shard_worker.model.quant import unquantized

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   10000000 kB\n")
    share = unquantized.BOTH_LAYOUTS_SHARE * 10_000_000 * 1024
    monkeypatch.setattr(cpu_linear, "amx_bf16", lambda: True)
    assert unquantized.both_layouts_fit(int(share), str(meminfo))
    assert not unquantized.both_layouts_fit(int(share) + 1, str(meminfo))
    assert not unquantized.both_layouts_fit(1, str(tmp_path / "none"))
    monkeypatch.setattr(cpu_linear, "amx_bf16", lambda: False)
    assert not unquantized.both_layouts_fit(1, str(meminfo))
