"""The CPU linear kernel's int8 weight-only product (csrc/cpu_linear_int8.cpp through cpu_linear.py) against
the dequantized product x @ (q * scale[:, None]).T in float64, with x rounded to bfloat16 where the build
multiplies in bf16 (AVX-512 BF16) and kept float32 elsewhere, on every path this machine can run: native
(AVX-512 BF16 here), `avx512` (AVX-512F without BF16: float32 FMA), `avx2` and `scalar`; M = 1..64 rows
(one pass, chunks of 8), odd K and N off the 16-row blocks, both x dtypes, bias; and with a scale per group
of 16 or 32 k (GGUF's Q6_K, Q8_0); W8A8 (x quantized per row, AVX-512 VNNI) against matmul_dynamic's rule.
And its seat in the int8 methods (products.pack_int8): the layer's `weight` holds the layout.

Tolerance: float32 sums of K exact products (a bf16 x bf16 product is exact in float32, int8 values are
exact in both) in any order are within K * 2^-24 * sum_k |x_k w_k| of the exact sum (2x for the fused pair
products), plus the scale's and bias's float32 roundings (2^-23 of the value) and a bfloat16 output's
(2^-8)."""

from __future__ import annotations

import pytest
import torch

from shard_worker.model.layers.linear import ColumnParallelLinear
from shard_worker.model.quant import cpu_linear, products
from shard_worker.model.quant.base import replace_param, weight_bytes
from shard_worker.model.quant.compressed_tensors import Fp8Method, Int8Method
from shard_worker.model.quant.kernels import PackedInt8
from shard_worker.model.quant.online import OnlineFp8Method
from shard_worker.parallel import TensorParallel
from tests.unit.test_cpu_linear import X86, _cpu_has

VARIANTS = [
    "native",
    pytest.param("avx512", marks=pytest.mark.skipif(not _cpu_has("avx512f"), reason="no AVX-512F")),
    pytest.param("avx2", marks=pytest.mark.skipif(not (X86 and _cpu_has("avx2", "fma")), reason="no AVX2")),
    pytest.param("scalar", marks=pytest.mark.skipif(not X86, reason="x86 flag set")),
]
SHAPES = [(17, 33), (48, 64), (100, 31), (200, 2101)]  # (N, K): odd K, N off the blocks, K in pieces
ROWS = [1, 3, 8, 9, 17, 64]


def _quantized(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 too (pack-quantized's)
    return q, torch.rand(n, generator=gen) * 0.01 + 1e-4


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()[:, None]


def _check(y: torch.Tensor, x, w: torch.Tensor, bias, rounds_x: bool) -> None:
    """y against x @ w.T (+ bias) in float64, w the dequantized weight."""
    xr = (x.bfloat16() if rounds_x else x).double()
    w = w.double()
    want = xr @ w.T + (0 if bias is None else bias.double())
    bound = 2 * w.shape[1] * 2**-24 * (xr.abs() @ w.abs().T) + 2**-23 * want.abs()
    if y.dtype == torch.bfloat16:
        bound = bound + 2**-8 * want.abs()
    excess = (y.double() - want).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16_x", "f32_x"])
def test_int8_products_match_the_dequantized_product(variant, x_dtype):
    if cpu_linear.EXT.unavailable(variant) is not None:
        pytest.skip(cpu_linear.EXT.unavailable(variant))
    rounds_x = cpu_linear.int8_rounds_x(variant)
    assert rounds_x == (variant == "native" and _cpu_has("avx512_bf16"))
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        q, scale = _quantized(n, k, gen)
        packed = cpu_linear.PackedLinear.pack(q, variant, scale)
        assert torch.equal(packed.unpack(), q) and torch.equal(packed.scale, scale)
        for i, m in enumerate(ROWS):
            x = torch.randn(m, k, generator=gen).to(x_dtype)
            bias = None if i % 3 == 0 else torch.randn(n, generator=gen).to((x_dtype, torch.float32)[i % 2])
            y = cpu_linear.linear(x, packed, bias)
            assert y.dtype == x_dtype and y.shape == (m, n)
            _check(y, x, _dequantized(q, scale), bias, rounds_x)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", VARIANTS)
def test_int8_products_with_a_scale_per_group_of_k(variant):
    """GGUF's Q8_0 (groups of 32) and Q6_K (16): w[n, k] = q[n, k] * scale[n, k // g]."""
    if cpu_linear.EXT.unavailable(variant) is not None:
        pytest.skip(cpu_linear.EXT.unavailable(variant))
    gen = torch.Generator().manual_seed(5)
    for n, k, g in [(17, 64, 32), (100, 96, 16), (40, 4160, 32)]:  # the last: K in pieces of 2048
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4
        packed = cpu_linear.PackedLinear.pack(q, variant, scale)
        assert torch.equal(packed.unpack(), q) and torch.equal(packed.scales(), scale)
        dequantized = (q.float().view(n, -1, g) * scale[..., None]).view(n, k)
        for i, m in enumerate(ROWS):
            x = torch.randn(m, k, generator=gen).to((torch.float32, torch.bfloat16)[i % 2])
            y = cpu_linear.linear(x, packed)
            _check(y, x, dequantized, None, cpu_linear.int8_rounds_x(variant))


def _per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.PackedInt8.matmul_dynamic's rule for x: (x_q, scale) per row, in float32 operations."""
    rows = x.float()
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(rows / scale).clamp(-127, 127), scale


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", VARIANTS)
def test_w8a8_products_quantize_each_row_of_x_like_matmul_dynamic(variant):
    """Exact int32 sums of x_q q, times both scales: float32 roundings of the result only."""
    if cpu_linear.EXT.unavailable(variant) is not None:
        pytest.skip(cpu_linear.EXT.unavailable(variant))
    gen = torch.Generator().manual_seed(6)
    for n, k in SHAPES:
        q, scale = _quantized(n, k, gen)
        packed = cpu_linear.PackedLinear.pack_w8a8(q, scale, variant)
        assert torch.equal(packed.unpack(), q) and torch.equal(packed.scales(), scale)
        for i, m in enumerate(ROWS):
            x = torch.randn(m, k, generator=gen).to((torch.float32, torch.bfloat16)[i % 2])
            bias = None if i % 3 == 0 else torch.randn(n, generator=gen)
            y = cpu_linear.linear(x, packed, bias)
            xq, xs = _per_token(x)
            product = (xq.double() @ q.double().T) * xs.double() * scale.double()
            want = product + (0 if bias is None else bias.double())
            bound = 2**-21 * (product.abs() + (0 if bias is None else bias.double().abs()))
            bound = bound + (2**-8 * want.abs() if y.dtype == torch.bfloat16 else 0)
            assert ((y.double() - want).abs() - bound).max().item() <= 0


def test_a_row_gets_the_same_bits_alone_in_a_batch_and_on_any_thread_count():
    """Each output's sum runs over K in the same order whatever the number of rows or threads."""
    gen = torch.Generator().manual_seed(1)
    q, scale = _quantized(300, 1100, gen)
    assert_same_bits_alone_batched_and_threaded(
        cpu_linear.PackedLinear.pack(q, scale=scale), torch.randn(40, 1100, generator=gen)
    )


def assert_same_bits_alone_batched_and_threaded(packed, x: torch.Tensor) -> None:
    """Rows 0, 17, 39 of x (40 rows) alone, in the batch on one thread, and on two: the same bits."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.linear(x, packed)
        alone = torch.cat([cpu_linear.linear(x[i : i + 1], packed) for i in (0, 17, 39)])
        torch.set_num_threads(2)
        two = cpu_linear.linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one[[0, 17, 39]], alone)


def test_row_parallel_shards_sum_to_the_whole_product():
    """Tensor parallelism shards q and scale before packing: K split in two, the partial sums add up."""
    gen = torch.Generator().manual_seed(2)
    q, scale = _quantized(64, 96, gen)
    x = torch.randn(5, 96, generator=gen)
    parts = [
        cpu_linear.linear(x[:, s], cpu_linear.PackedLinear.pack(q[:, s], scale=scale))
        for s in (
            slice(0, 48),
            slice(48, 96),
        )
    ]
    torch.testing.assert_close(
        parts[0] + parts[1], cpu_linear.linear(x, cpu_linear.PackedLinear.pack(q, scale=scale))
    )


def test_an_int8_weight_needs_its_scale_and_groups_the_kernel_takes():
    with pytest.raises(ValueError, match="scale"):
        cpu_linear.PackedLinear.pack(torch.zeros(16, 16, dtype=torch.int8))
    with pytest.raises(ValueError, match="scale"):
        cpu_linear.PackedLinear.pack(torch.zeros(16, 16), scale=torch.ones(16))
    with pytest.raises(ValueError, match="groups"):  # groups of 3 k
        cpu_linear.PackedLinear.pack(torch.zeros(16, 24, dtype=torch.int8), scale=torch.ones(16, 8))


def _int8_layer(q: torch.Tensor, scale: torch.Tensor, bias, w8a8: bool = False) -> ColumnParallelLinear:
    """A compressed-tensors W8A16 (W8A8) layer as the loader leaves it: weight and weight_scale filled,
    processed."""
    layer = ColumnParallelLinear(q.shape[1], q.shape[0], TensorParallel(), bias=bias is not None)
    method = Int8Method(w8a8=w8a8)
    layer.quant_method = method
    del layer.weight
    method.create_weights(layer, q.shape[1], [q.shape[0]], torch.float32)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale[:, None])
    if bias is not None:
        replace_param(layer, "bias", bias.clone())
    method.process_weights_after_loading(layer)
    return layer


def test_the_weight_only_int8_method_holds_the_kernel_layout():
    if not cpu_linear.available(torch.int8):
        pytest.skip("this CPU runs int8 weights through aten._weight_int8pack_mm")
    gen = torch.Generator().manual_seed(3)
    q, scale = _quantized(70, 36, gen)
    b = torch.randn(70, generator=gen)
    layer = _int8_layer(q, scale, b)
    assert isinstance(layer.cpu_packed, cpu_linear.PackedLinear) and getattr(layer, "packed", None) is None
    assert layer.weight.data_ptr() == layer.cpu_packed.data.data_ptr()  # the parameter holds the layout
    assert weight_bytes(layer) == 80 * 36 + 4 * 70 + 4 * 70  # 5 blocks of int8, the scales, the bias
    x = torch.randn(3, 36, generator=gen)
    _check(layer(x), x, _dequantized(q, scale), b, cpu_linear.int8_rounds_x())
    xd = x.double()  # another dtype: the weight dequantized in float32, F.linear
    torch.testing.assert_close(layer(xd), xd @ (q.float() * scale[:, None]).double().T + b.double())


def test_the_w8a8_method_holds_the_vnni_layout():
    if not cpu_linear.available_w8a8():
        pytest.skip("this CPU runs W8A8 products through fbgemm")
    gen = torch.Generator().manual_seed(7)
    q, scale = _quantized(40, 52, gen)
    layer = _int8_layer(q, scale, None, w8a8=True)
    assert layer.cpu_packed.code == cpu_linear.W8A8 and getattr(layer, "packed", None) is None
    assert layer.weight.data_ptr() == layer.cpu_packed.data.data_ptr()
    x = torch.randn(3, 52, generator=gen)
    # The per-token rule as written (PackedInt8's float64 path; its fbgemm one quantizes x its own way).
    exact = PackedInt8.pack(q, scale).matmul_dynamic(x.double())
    torch.testing.assert_close(layer(x), exact.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.double()), exact)  # another dtype: that rule in torch


def test_without_the_kernel_the_method_keeps_weight_int8pack_mm(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available", lambda dtype: False)
    gen = torch.Generator().manual_seed(4)
    q, scale = _quantized(32, 48, gen)
    layer = _int8_layer(q, scale, None)
    assert isinstance(layer.packed, PackedInt8) and getattr(layer, "cpu_packed", None) is None
    assert layer.packed.kernel == "weight_int8pack_mm"
    x = torch.randn(2, 48, generator=gen)
    torch.testing.assert_close(layer(x), x @ (q.float() * scale[:, None]).T, rtol=2e-2, atol=2e-2)


def _every_e4m3(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[N, K] e4m3 drawn from every byte but NaN's (0x7f, 0xff): subnormals, zeros, signs, +-448."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    return codes[torch.randint(0, len(codes), (n, k), generator=gen)].view(torch.float8_e4m3fn)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_products_widen_every_e4m3_value_exactly(variant):
    """e4m3 bytes in the int8 layout, widened in registers by bit moves (normal values) and a table
    (subnormals): against x @ (float(q) * scale).T in float64, the bound of the int8 products."""
    if cpu_linear.EXT.unavailable(variant) is not None:
        pytest.skip(cpu_linear.EXT.unavailable(variant))
    gen = torch.Generator().manual_seed(8)
    for n, k in SHAPES:
        q = _every_e4m3(n, k, gen)
        scale = torch.rand(n, generator=gen) + 0.05
        packed = cpu_linear.PackedLinear.pack(q, variant, scale)
        assert packed.code == cpu_linear.FP8 and packed.unpack().dtype == torch.float8_e4m3fn
        assert torch.equal(packed.unpack().view(torch.uint8), q.view(torch.uint8))
        # One-hot rows of x read each weight alone: exact, so a wrong widening of any value shows.
        columns = cpu_linear.linear(torch.eye(k), packed).T
        assert torch.equal(columns, q.float() * scale[:, None])
        for i, m in enumerate(ROWS):
            x = torch.randn(m, k, generator=gen).to((torch.float32, torch.bfloat16)[i % 2])
            bias = None if i % 3 == 0 else torch.randn(n, generator=gen)
            y = cpu_linear.linear(x, packed, bias)
            _check(y, x, q.double() * scale.double()[:, None], bias, cpu_linear.int8_rounds_x(variant))


@pytest.mark.parametrize("method", ["online", "compressed-tensors W8A8"])
def test_the_fp8_methods_hold_the_kernel_layout(method):
    """--quantization fp8 and compressed-tensors float-quantized: the layer's weight holds the layout, and
    its product equals fp8_linear's (the dequantized product) up to x's rounding to bf16."""
    if not cpu_linear.available(torch.float8_e4m3fn):
        pytest.skip("this CPU multiplies e4m3 weights by dequantizing them")
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(40, 64, generator=gen) * 0.05
    q, scale = products.quantize_fp8(w)
    layer = ColumnParallelLinear(64, 40, TensorParallel(), bias=False)
    if method == "online":
        layer.quant_method, name, dynamic = OnlineFp8Method(), "weight_fp8", False
        layer.quant_method.quantize(layer, w)
    else:
        layer.quant_method, name, dynamic = Fp8Method(False, True, True), "weight", True
        del layer.weight
        layer.quant_method.create_weights(layer, 64, [40], torch.float32)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale[:, None])
        layer.quant_method.process_weights_after_loading(layer)
    assert getattr(layer, name).data_ptr() == layer.cpu_packed.data.data_ptr()
    x = torch.randn(3, 64, generator=gen)
    xk = x.bfloat16().float() if cpu_linear.int8_rounds_x() else x
    if dynamic:  # the per-token rounding first, then the kernel's
        xk = products.round_fp8_per_token(x)
        xk = xk.bfloat16().float() if cpu_linear.int8_rounds_x() else xk
    want = products.fp8_linear(xk, q, scale, None, dynamic_act=False)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    xd = x.double()  # another dtype: the dequantized product in torch
    torch.testing.assert_close(layer(xd), products.fp8_linear(xd, q, scale, None, dynamic_act=dynamic))
