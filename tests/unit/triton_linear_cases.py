"""Cases for tests/unit/test_triton_linear.py: the Triton weight-only GEMM (shard_worker/model/quant/
triton_linear.py) under the interpreter, against a float64 product with the dequantized weight written
here from the quantization rule (not from the kernel's code).

Run as `TRITON_INTERPRET=1 python tests/unit/triton_linear_cases.py CASE...` (one process per test: an
out-of-bounds load segfaults the interpreter). Prints one JSON line per check and exits 1 if any fails.

Errors are relative to the product's largest magnitude. The kernel rounds each dequantized weight to x's
dtype before the dot (as dequantize + matmul does) and its output to x's dtype; the interpreter truncates
to bfloat16 instead of rounding. Measured: float32 ~1e-7, float16 ~5e-4, bfloat16 ~4e-3.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("set TRITON_INTERPRET=1: the kernel runs on CPU tensors only under Triton's interpreter")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from shard_worker.model.quant import int8_groups, kernels, triton_linear  # noqa: E402
from tests.unit.interpreted import run_cases  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
RESULTS: list[dict] = []


def int4_weight(n: int, k: int, group: int, zeros: str, seed: int):
    """q 0..15 [N, K], scale [N, K / g], zero [N, K / g] or None. zeros: "none" (symmetric: 8), "int"
    (AWQ/GPTQ-like 0..15) or "float" (GGUF Q4_K-like offsets)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
    zero = None
    if zeros == "int":
        zero = torch.randint(0, 16, (n, k // group), generator=gen).float()
    elif zeros == "float":
        zero = torch.rand(n, k // group, generator=gen) * 15
    return q, scale, zero


def dequantize_int4(q, scale, zero, group: int) -> torch.Tensor:
    """float64 w[n, k] = (q[n, k] - zero[n, k // g]) * scale[n, k // g], zero 8 when None."""
    groups = torch.arange(q.shape[1]) // group
    z = torch.full_like(scale, 8.0) if zero is None else zero
    return (q.double() - z.double()[:, groups]) * scale.double()[:, groups]


def pack_int4(q, scale, zero):
    """The layout the kernel reads, built here independently: nibbles along K, low first; scales [G, N]."""
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return packed, scale.t().contiguous(), None if zero is None else zero.t().contiguous()


def check(
    case: str, name: str, got: torch.Tensor, want: torch.Tensor, dtype, tol: float | None = None
) -> float:
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    diff = (got.double() - want).abs().max()
    err = float(diff / want.abs().max()) if torch.isfinite(diff) else math.inf
    tol = TOLERANCE[dtype] if tol is None else tol
    RESULTS.append({"case": case, "check": name, "dtype": str(dtype)[6:], "max_err": err, "tol": tol})
    return err


def record(case: str, name: str, ok: bool, detail: float = 0.0) -> None:
    RESULTS.append(
        {"case": case, "check": name, "max_err": 0.0 if ok else math.inf, "tol": 0.0, "detail": detail}
    )


def rows(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (M, N, K, group, zeros): M = 1 and odd M, N and K off the block sizes (64 / 128 / 128 at decode), the
# prefill tiles (M > 64), groups of 32 and 128, symmetric, integer and float zero points.
INT4_SHAPES = [
    (1, 48, 256, 128, "none"),
    (1, 70, 96, 32, "int"),
    (5, 33, 384, 128, "int"),
    (17, 130, 64, 32, "float"),
    (70, 20, 160, 32, "int"),
]


def case_int4_shapes() -> None:
    for i, (m, n, k, group, zeros) in enumerate(INT4_SHAPES):
        q, scale, zero = int4_weight(n, k, group, zeros, seed=i)
        want_w = dequantize_int4(q, scale, zero, group)
        packed, scale_t, zero_t = pack_int4(q, scale, zero)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = rows(m, k, dtype, seed=10 + i)
            got = triton_linear.int4_matmul(x, packed, scale_t, zero_t, group)
            check(
                "int4_shapes",
                f"M={m} N={n} K={k} g={group} zeros={zeros}",
                got,
                x.double() @ want_w.t(),
                dtype,
            )


def case_int4_catches_wrong_zero_and_group() -> None:
    """The data tell a right zero point and group index from a wrong one: the kernel's output against a
    reference with the zero forgotten (8) or each group's scale taken from the next group is many
    tolerances off (and the kernel matches the right one, checked above and here)."""
    m, n, k, group = 3, 40, 128, 32
    q, scale, zero = int4_weight(n, k, group, "int", seed=7)
    packed, scale_t, zero_t = pack_int4(q, scale, zero)
    x = rows(m, k, torch.float32, seed=8)
    got = triton_linear.int4_matmul(x, packed, scale_t, zero_t, group).double()
    right = x.double() @ dequantize_int4(q, scale, zero, group).t()
    no_zero = x.double() @ dequantize_int4(q, scale, None, group).t()
    shifted = x.double() @ dequantize_int4(q, scale.roll(1, dims=1), zero.roll(1, dims=1), group).t()
    check("int4_wrong", "right zero and group", got.float(), right, torch.float32)
    for name, wrong in (("zero ignored", no_zero), ("group index off by one", shifted)):
        err = float((got - wrong).abs().max() / wrong.abs().max())
        record(
            "int4_wrong",
            f"{name}: {err:.3f} off, over 100 tolerances",
            err > 100 * TOLERANCE[torch.float32],
            err,
        )


INT8_SHAPES = [(1, 40, 100), (9, 64, 300), (66, 50, 72), (2, 129, 16)]


def case_int8_shapes() -> None:
    for i, (m, n, k) in enumerate(INT8_SHAPES):
        gen = torch.Generator().manual_seed(i)
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, generator=gen) * 0.01 + 0.001
        want_w = q.double() * scale.double()[:, None]
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = rows(m, k, dtype, seed=20 + i)
            got = triton_linear.int8_matmul(x, q, scale)
            check("int8_shapes", f"M={m} N={n} K={k}", got, x.double() @ want_w.t(), dtype)


def int8_groups_weight(n: int, k: int, group: int, seed: int):
    """q int8 [N, K] and scale float32 [N, K / g] (GGUF Q8_0 / Q6_K-like), and the float64 weight."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    return q, scale, q.double() * scale.double().repeat_interleave(group, dim=1)


def case_int8_groups() -> None:
    """int8 with a scale per group of 16 or 32 along K (scales transposed to [K / g, N]); and the same
    data against a reference with each group's scale taken from the next group: far off."""
    for i, (m, n, k, group) in enumerate([(1, 40, 64, 16), (5, 33, 96, 32), (70, 20, 128, 32)]):
        q, scale, want_w = int8_groups_weight(n, k, group, seed=30 + i)
        for dtype in (torch.float32, torch.bfloat16):
            x = rows(m, k, dtype, seed=40 + i)
            got = triton_linear.int8_matmul(x, q, scale.t().contiguous(), group)
            check("int8_groups", f"M={m} N={n} K={k} g={group}", got, x.double() @ want_w.t(), dtype)
        shifted = x.double() @ (q.double() * scale.roll(1, 1).double().repeat_interleave(group, 1)).t()
        err = float((got.double() - shifted).abs().max() / shifted.abs().max())
        record("int8_groups", f"group index off by one: {err:.3f} off", err > 10 * TOLERANCE[dtype], err)


def case_split_k() -> None:
    """The same product with K unsplit and split 2 and 3 ways (the last split shorter): equal within the
    float32 sums' reordering. The planner's choice for a decode here splits (4 'SMs' when interpreted)."""
    m, n, k, group = 2, 24, 192, 32
    q, scale, zero = int4_weight(n, k, group, "int", seed=3)
    packed, scale_t, zero_t = pack_int4(q, scale, zero)
    x = rows(m, k, torch.float32, seed=4)
    want = x.double() @ dequantize_int4(q, scale, zero, group).t()
    planned = triton_linear.plan(m, n, k, group, 4)
    record("split_k", f"decode planned with split_k={planned.split_k} > 1", planned.split_k > 1)
    for split, per in ((1, 192), (2, 96), (3, 64), (2, 128)):  # the last: 128 then 64
        p = triton_linear.Plan(16, 16, 32, split, per, 4, 2)
        got = triton_linear.int4_matmul(x, packed, scale_t, zero_t, group, plan_=p)
        check("split_k", f"split {split} x {per}", got, want, torch.float32)
    xq = torch.randint(-127, 128, (n, 100), dtype=torch.int8)
    s8 = torch.rand(n) * 0.01
    x8 = rows(3, 100, torch.float32, seed=5)
    want8 = x8.double() @ (xq.double() * s8.double()[:, None]).t()
    empty = triton_linear.int8_matmul(torch.zeros(2, 0, 100), xq, s8)  # a step with no rows
    record("split_k", "no rows: [2, 0, N], nothing launched", empty.shape == (2, 0, n))
    p = triton_linear.Plan(16, 16, 32, 2, 64, 4, 2)  # 64 + 36: the second split's tail is masked
    check(
        "split_k",
        "int8 split 2, K tail",
        triton_linear.int8_matmul(x8, xq, s8, plan_=p),
        want8,
        torch.float32,
    )


def case_packed_weights() -> None:
    """The wiring: PackedInt4 / PackedInt8 choose the Triton kernel where kernels.TRITON_DEVICES says
    (CUDA in a server; CPU added here, as the interpreter runs it), and their matmul gives the product;
    a group the kernel cannot step (16 < its power-of-two part) keeps the dequantize path."""
    kernels.TRITON_DEVICES = ("cuda", "cpu")
    n, k, group = 36, 256, 128
    q, scale, zero = int4_weight(n, k, group, "float", seed=11)
    for zero_ in (None, zero):
        packed = kernels.PackedInt4.pack(q, scale, zero_, group)
        record("packed", f"PackedInt4 kernel {packed.kernel!r}", packed.kernel == "triton int4")
        record("packed", "PackedInt4 unpack", torch.equal(packed.unpack(), q))
        for dtype in (torch.float32, torch.bfloat16):
            x = rows(4, k, dtype, seed=12)
            want = x.double() @ dequantize_int4(q, scale, zero_, group).t()
            check(
                "packed",
                f"PackedInt4 zero={'none' if zero_ is None else 'float'}",
                packed.matmul(x),
                want,
                dtype,
            )
    odd = kernels.PackedInt4.pack(q[:, :240], torch.rand(n, 10), None, 24)  # group 24: power-of-two part 8
    record("packed", f"group 24 kernel {odd.kernel!r}", odd.kernel != "triton int4")
    qg, sg, wg = int8_groups_weight(n, 96, 32, seed=14)
    groups = int8_groups.PackedInt8Groups.pack(qg, sg, 32)
    record("packed", f"PackedInt8Groups kernel {groups.kernel!r}", groups.kernel == "triton int8 groups")
    x = rows(2, 96, torch.float32, seed=15)
    check("packed", "PackedInt8Groups", groups.matmul(x), x.double() @ wg.t(), torch.float32)
    q8 = torch.randint(-127, 128, (n, 72), dtype=torch.int8)
    s8 = torch.rand(n) * 0.01
    p8 = kernels.PackedInt8.pack(q8, s8)
    record("packed", f"PackedInt8 kernel {p8.kernel!r}", p8.kernel == "triton int8")
    x = rows(3, 72, torch.bfloat16, seed=13)
    want = x.double() @ (q8.double() * s8.double()[:, None]).t()
    check("packed", "PackedInt8", p8.matmul(x), want, torch.bfloat16)


if __name__ == "__main__":
    sys.exit(run_cases(globals(), RESULTS, sys.argv[1:]))
