"""The CPU linear kernel's 4-bit product (csrc/cpu_linear_int4.cpp through cpu_linear.py) against x times
the dequantized weight, w = q * scale + offset per row and group of k, in float64: on every path this
machine can run (native: AVX-512 BF16 here, x rounded to bf16; `avx512`, `avx2`, `scalar`: x in float32),
1..64 rows (one pass, chunks of 8), N off the 16-row blocks, K in pieces of 2048, groups of 8 to 2048, both
x dtypes, bias; a row's bits alone, in a batch and on two threads; tensor-parallel shards; and its seat
under kernels.PackedInt4 (what AWQ, GPTQ, compressed-tensors W4A16 and GGUF's 4-bit types load into).

Tolerance: the kernel sums x q per group in float32 (exact products: q is exact in bf16 and float32) and
x per group, then folds s * sum(x q) + o * sum(x) (on the bf16 path s * sum(x (128 + q)) + (o - 128 s)
sum(x): its widening is one bit operation): each float32 sum of K terms in any order is within K * 2^-24
of its terms' absolute sum, so the result is within 4 K 2^-24 (|x| @ (|(q + 128) s| + |o|)^T) of the
exact one, plus 2^-23 of the value (the folds, the bias) and a bf16 output's 2^-8. A wrong nibble, group
or offset is off by orders of magnitude more."""

from __future__ import annotations

import pytest
import torch

from shard_worker.model.quant import cpu_linear
from shard_worker.model.quant.kernels import PackedInt4
from tests.unit.test_cpu_linear_int8 import VARIANTS, assert_same_bits_alone_batched_and_threaded

CASES = [(17, 64, 32), (48, 128, 64), (100, 96, 8), (40, 4160, 32), (33, 2048, 2048), (64, 576, 64)]
ROWS = [1, 3, 8, 9, 17, 64]


def _int4(n: int, k: int, g: int, gen: torch.Generator):
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4
    return q, scale, -scale * (torch.rand(n, k // g, generator=gen) * 15)  # an offset: -zero * scale


def _dequantized(q, scale, offset) -> torch.Tensor:
    g = q.shape[1] // scale.shape[1]
    return q.double() * scale.double().repeat_interleave(g, 1) + offset.double().repeat_interleave(g, 1)


def _check(y, x, q, scale, offset, bias, rounds_x: bool) -> None:
    xr = (x.bfloat16() if rounds_x else x).double()
    w = _dequantized(q, scale, offset)
    g = q.shape[1] // scale.shape[1]
    # Where x is rounded to bf16 the kernel sums x (128 + q) and takes 128 s sum(x) back off.
    biased = q.double() + (128 if rounds_x else 0)
    magnitude = biased * scale.double().repeat_interleave(g, 1) + offset.double().abs().repeat_interleave(
        g, 1
    )
    want = xr @ w.T + (0 if bias is None else bias.double())
    bound = 4 * q.shape[1] * 2**-24 * (xr.abs() @ magnitude.T) + 2**-23 * want.abs()
    if bias is not None:
        bound = bound + 2**-23 * bias.double().abs()
    if y.dtype == torch.bfloat16:
        bound = bound + 2**-8 * want.abs()
    excess = (y.double() - want).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16_x", "f32_x"])
def test_int4_products_match_the_dequantized_product(variant, x_dtype):
    if cpu_linear.EXT.unavailable(variant) is not None:
        pytest.skip(cpu_linear.EXT.unavailable(variant))
    rounds_x = cpu_linear.int8_rounds_x(variant)
    gen = torch.Generator().manual_seed(0)
    for n, k, g in CASES:
        q, scale, offset = _int4(n, k, g, gen)
        packed = cpu_linear.PackedLinear.pack_int4(q, scale, offset, variant)
        assert packed.code == cpu_linear.INT4 and packed.data.numel() == -(-n // 16) * 16 * k // 2
        assert torch.equal(packed.unpack(), q)
        assert torch.equal(packed.scales(), torch.stack([scale, offset]))
        torch.testing.assert_close(packed.dequantize(torch.float32), _dequantized(q, scale, offset).float())
        for i, m in enumerate(ROWS[:4] if k > 2048 else ROWS):
            x = torch.randn(m, k, generator=gen).to(x_dtype)
            bias = None if i % 3 == 0 else torch.randn(n, generator=gen).to((x_dtype, torch.float32)[i % 2])
            y = cpu_linear.linear(x, packed, bias)
            assert y.dtype == x_dtype and y.shape == (m, n)
            _check(y, x, q, scale, offset, bias, rounds_x)


def test_a_row_gets_the_same_bits_alone_in_a_batch_and_on_any_thread_count():
    gen = torch.Generator().manual_seed(1)
    q, scale, offset = _int4(300, 1152, 128, gen)
    packed = cpu_linear.PackedLinear.pack_int4(q, scale, offset)
    assert_same_bits_alone_batched_and_threaded(packed, torch.randn(40, 1152, generator=gen))


def test_row_parallel_shards_sum_to_the_whole_product():
    """A row-parallel layer's rank holds K / 2 and its groups' scales and offsets: the halves add up."""
    gen = torch.Generator().manual_seed(2)
    q, scale, offset = _int4(64, 256, 32, gen)
    x = torch.randn(5, 256, generator=gen)
    halves = [
        cpu_linear.linear(
            x[:, 128 * h : 128 * (h + 1)],
            cpu_linear.PackedLinear.pack_int4(*(t.chunk(2, 1)[h] for t in (q, scale, offset))),
        )
        for h in (0, 1)
    ]
    whole = cpu_linear.linear(x, cpu_linear.PackedLinear.pack_int4(q, scale, offset))
    torch.testing.assert_close(halves[0] + halves[1], whole)


def test_groups_the_kernel_cannot_take_are_refused_and_packedint4_regroups():
    q = torch.zeros(16, 24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="groups of 6"):
        cpu_linear.PackedLinear.pack_int4(q, torch.ones(16, 4), torch.zeros(16, 4))
    assert cpu_linear.int4_group(6, 24) == 0 and cpu_linear.int4_group(576, 576) == 64
    assert cpu_linear.int4_group(4096, 4096) == 2048 and cpu_linear.int4_group(128, 4096) == 128


@pytest.mark.skipif(not cpu_linear.available_int4(), reason="this CPU runs int4 through tinygemm")
@pytest.mark.parametrize("group,symmetric", [(576, False), (32, True)])
def test_packedint4_runs_the_kernel_at_a_group_it_takes(group, symmetric):
    """Per channel (group = K = 576: the kernel's group 64, the scales repeated) and symmetric (zero 8)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 576
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01
    zero = None if symmetric else torch.rand(n, k // group, generator=gen) * 15
    packed = PackedInt4.pack(q, scale, zero, group)
    assert packed.kernel == "cpu_linear int4" and torch.equal(packed.unpack(), q)
    assert packed.qweight.data_ptr() == packed.cpu_packed.data.data_ptr()
    assert packed.nbytes == 48 * k // 2 + 4 * 2 * 48 * (k // cpu_linear.int4_group(group, k))
    w = packed.dequantize(torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, k, generator=gen).to(dtype)
        s, o = packed.cpu_packed.scales()
        _check(packed.matmul(x), x, q, s, o, None, cpu_linear.int8_rounds_x())
        xr = (x.bfloat16() if cpu_linear.int8_rounds_x() else x).double()
        torch.testing.assert_close(packed.matmul(x).double(), xr @ w.T, rtol=1e-2, atol=1e-2)
