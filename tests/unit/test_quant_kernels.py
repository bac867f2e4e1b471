"""PackedInt8 / PackedInt4 (shard_worker/model/quant/kernels.py): products against the dequantized
weight, exact round trips, odd shapes served by the fallback, and the W8A8 path's per-token rule.

Tolerances, and why: the CPU kernels take activations in bfloat16 (x rounded: relative error <= 2^-9 per
element), their scales in bfloat16 (<= 2^-9 relative, and for int4 the offset (8 - zero) * scale too),
and return bfloat16 (<= 2^-9 of the result), summing in float32. So each output may differ from the
float32 product with the dequantized weight by at most about 2^-9 * (|x| @ |W|^T) per rounded input
(x, scale, offset) plus 2^-9 * |y|: the bound below is 2^-7 * (|x| @ (|W| + |offset| + 8 |scale|)^T)
+ 2^-8 |y|, twice that sum, which a wrong index or a wrong zero point breaks by orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shard_worker.model.quant import cpu_linear, kernels
from shard_worker.model.quant.kernels import PackedInt4, PackedInt8

torch.set_flush_denormal(True)


def random_int8(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, generator=g) * 0.01 + 1e-3


def random_int4(n: int, k: int, group: int, symmetric: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    zero = None if symmetric else torch.rand(n, k // group, generator=g) * 15  # non-integer (Q4_K)
    return q, scale, zero


def assert_within_bound(y, x, weight, extra=None):
    """The module docstring's bound, elementwise."""
    ref = F.linear(x.double(), weight.double())
    magnitude = weight.double().abs() if extra is None else weight.double().abs() + extra.double()
    bound = 2**-7 * (x.double().abs() @ magnitude.t()) + 2**-8 * ref.abs() + 1e-6
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], weight.shape[0])


def int4_extra(packed: PackedInt4) -> torch.Tensor:
    """|offset| + 8 |scale| per weight: what the bf16 rounding of the kernel's scales can move."""
    g = packed.group_size
    zero = 8.0 if packed.zero is None else packed.zero
    offset = ((8 - zero) * packed.scale).abs() + 8 * packed.scale
    return offset.repeat_interleave(g, dim=1)


@pytest.mark.parametrize("n,k", [(64, 576), (192, 576), (37, 100), (16, 24), (16, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_matches_dequantized(n, k, dtype):
    q, scale = random_int8(n, k)
    packed = PackedInt8.pack(q, scale)
    assert packed.kernel == ("weight_int8pack_mm" if k % 16 == 0 else "dequantize")
    weight = packed.dequantize(torch.float32)
    for shape in [(1, k), (5, k), (2, 3, k)]:
        x = torch.randn(*shape).to(dtype)
        assert_within_bound(packed.matmul(x), x, weight)


@pytest.mark.parametrize(
    "n,k,group,symmetric",
    [
        (64, 576, 64, False),  # SmolLM2's K with its largest kernel group
        (32, 256, 128, True),
        (48, 512, 512, False),  # a group the kernel does not take, served by repeated scales
        (40, 128, 32, False),  # N not a multiple of 16: the fallback
        (16, 48, 16, False),  # group 16: the fallback
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ours", [True, False], ids=["cpu_linear", "aten"])
def test_int4_matmul_matches_dequantized(n, k, group, symmetric, dtype, ours, monkeypatch):
    """Our CPU kernel where it runs (every shape here), else tinygemm (aten) or the fallback."""
    if not ours:
        monkeypatch.setattr(cpu_linear, "available_int4", lambda: False)
    elif not cpu_linear.available_int4():
        pytest.skip("this CPU runs int4 through tinygemm")
    q, scale, zero = random_int4(n, k, group, symmetric)
    packed = PackedInt4.pack(q, scale, zero, group)
    aten = "dequantize" if n % 16 or group == 16 else "weight_int4pack_mm_for_cpu"
    assert packed.kernel == ("cpu_linear int4" if ours else aten)
    weight = packed.dequantize(torch.float32)
    for shape in [(1, k), (7, k), (2, 3, k)]:
        x = torch.randn(*shape).to(dtype)
        assert_within_bound(packed.matmul(x), x, weight, int4_extra(packed))


@pytest.mark.parametrize("n,k,group", [(64, 576, 64), (40, 128, 32), (48, 512, 512), (16, 20, 4)])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("ours", [True, False], ids=["cpu_linear", "aten"])
def test_int4_round_trip_is_exact(n, k, group, symmetric, ours, monkeypatch):
    if not ours:
        monkeypatch.setattr(cpu_linear, "available_int4", lambda: False)
    q, scale, zero = random_int4(n, k, group, symmetric, seed=3)
    packed = PackedInt4.pack(q, scale, zero, group)
    assert torch.equal(packed.unpack(), q)
    assert torch.equal(packed.scale, scale)
    if symmetric:
        assert packed.zero is None
    else:
        assert torch.equal(packed.zero, zero)
    expanded_zero = 8.0 if symmetric else zero.repeat_interleave(group, dim=1)
    expected = (q.float() - expanded_zero) * scale.repeat_interleave(group, dim=1)
    assert torch.equal(packed.dequantize(torch.float32), expected)


def test_int8_round_trip_is_exact():
    q, scale = random_int8(48, 96)
    packed = PackedInt8.pack(q, scale)
    assert torch.equal(packed.q, q) and torch.equal(packed.scale, scale)
    assert torch.equal(packed.dequantize(torch.float32), q.float() * scale[:, None])


@pytest.mark.parametrize("ours", [True, False], ids=["cpu_linear", "aten"])
def test_int4_kernel_layout_is_not_plain(ours, monkeypatch):
    # The round trip above is only meaningful if the kernel's layout differs from plain nibbles.
    if not ours:
        monkeypatch.setattr(cpu_linear, "available_int4", lambda: False)
    q, scale, zero = random_int4(64, 128, 32)
    packed = PackedInt4.pack(q, scale, zero, 32)
    plain = q[:, 0::2] | (q[:, 1::2] << 4)
    assert packed.kernel != "dequantize" and not torch.equal(packed.qweight.view(-1), plain.view(-1))


def test_packed_weights_are_non_persistent_submodules():
    layer = torch.nn.Module()
    layer.int8 = PackedInt8.pack(*random_int8(32, 64))
    layer.int4 = PackedInt4.pack(*random_int4(32, 64, 32), 32)
    assert layer.state_dict() == {} and list(layer.parameters()) == []
    x = torch.randn(3, 64)
    before = layer.int4.matmul(x)
    layer.to(torch.device("cpu"))
    assert torch.equal(layer.int4.matmul(x), before)
    assert layer.int8.nbytes == 32 * 64 + 6 * 32
    assert layer.int4.nbytes == 32 * 32 + 2 * 4 * 32 * 2


def test_pack_refuses_bad_inputs():
    q, scale, zero = random_int4(16, 64, 32)
    with pytest.raises(ValueError, match="multiple of group_size"):
        PackedInt4.pack(q, scale, zero, 48)
    with pytest.raises(ValueError, match="0..15"):
        PackedInt4.pack(q + 16, scale, zero, 32)
    with pytest.raises(ValueError, match="0..15"):
        PackedInt4.pack(q.to(torch.int32) - 1, scale, zero, 32)
    widened = PackedInt4.pack(q.to(torch.int32), scale, zero, 32)  # any integer dtype holding 0..15
    assert torch.equal(widened.unpack(), q)
    with pytest.raises(ValueError, match="int8"):
        PackedInt8.pack(q, scale[:, 0])


def test_int_mm_check_detects_saturation(monkeypatch):
    # The check must be able to say no: a product that saturates like oneDNN's AVX2 path.
    saturating = lambda a, b: (a.int() @ b.int()).clamp(-32768, 32767)  # noqa: E731
    kernels._int_mm_exact.cache_clear()
    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not kernels._int_mm_exact()
    kernels._int_mm_exact.cache_clear()


def per_token_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """|x_q - x| <= half a step per element; steps of absmax/127 (fbgemm without VNNI: 7 bits, absmax/63),
    so |y - x W^T| <= half a step * sum |W| per row and channel, plus float32 rounding."""
    levels = 63 if kernels._reduce_range() else 127
    half_step = x.abs().amax(dim=-1, keepdim=True) / levels / 2
    return 1.01 * half_step * weight.abs().sum(dim=1) + 1e-5


@pytest.mark.parametrize("fbgemm", [True, False])
@pytest.mark.parametrize("n,k", [(64, 192), (37, 100)])
def test_w8a8_dynamic_is_per_token(fbgemm, n, k, monkeypatch):
    if not fbgemm:
        monkeypatch.setattr(kernels, "_ENGINES", set())
    q, scale = random_int8(n, k)
    packed = PackedInt8.pack(q, scale)
    weight = packed.dequantize(torch.float32)
    x = torch.randn(6, k)
    x[2] *= 100  # an outlier token must not coarsen the others' quantization
    y = packed.matmul_dynamic(x)
    exact = x @ weight.t()
    assert bool(((y - exact).abs() <= per_token_bound(x, weight)).all())
    # Each row of a batch is quantized by its own range alone, whatever else is in the batch; a row
    # alone (fbgemm: its own span, a finer grid) stays within the same bound.
    for i in range(5):
        torch.testing.assert_close(packed.matmul_dynamic(x[i : i + 2]), y[i : i + 2], rtol=1e-5, atol=1e-5)
        alone = packed.matmul_dynamic(x[i])
        assert bool(((alone - exact[i]).abs() <= per_token_bound(x[i : i + 1], weight)[0]).all())
