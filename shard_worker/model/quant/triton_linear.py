"""Weight-only int4 and int8 products on CUDA: one Triton GEMM, y = x W^T, for the weights kernels.py holds.

    int4 (PackedInt4): q 0..15 in groups of g along K, w[n, k] = (q - zero[n, k // g]) * scale[n, k // g]
          (zero None: 8). Held as PackedInt4 already holds it off the CPU: two nibbles a byte along K,
          low nibble first, [N, K / 2] row-major; its scales (and zeros) transposed once at load to
          [K / g, N] float32, so a K step reads them as one coalesced row.
    int8 (PackedInt8): q int8 [N, K] row-major as held, scale per output channel [N] float32.

Why nibbles along K: it is the layout PackedInt4 keeps (unpack and dequantize read it; no second copy),
each output channel's tile of BLOCK_K weights is BLOCK_K / 2 contiguous bytes (vector loads, as the int8
rows are), and the two nibbles of a byte share a channel and a group, so one scale and zero serve the
pair. Unpacked in registers with tl.interleave (low, high) and dequantized in float32 to x's dtype, then
tl.dot with float32 accumulation (x float16/bfloat16; float32 takes the ieee dot, no TF32). int8 weights
(exact in 16-bit floats) go to the dot as they are and the channel's scale multiplies the sum once.

Tiles, by M (rows of x): decode (M <= 16) 16 x 64 output tiles stepping 64 along K; up to 64 rows 32/64 x
64 stepping 128; prefill 64 x 128 stepping 64 (float32 x: 64 wide, stepping 32). A K step never crosses a
group (BLOCK_K divides g; groups whose power-of-two part is under 16 are not served here). When the output
tiles would not fill the GPU's SMs (decode: a 4096-wide product makes 64 tiles on 132 SMs) K is split
among programs that write float32 partials, summed after. The sizes follow what vLLM's and SGLang's Triton
weight-only GEMMs use for small and large M; they are UNTUNED: no GPU was lent to this project when they
were written, so they are proven correct (tests/unit/test_triton_linear.py, under TRITON_INTERPRET=1) but
not timed.

Importing this module imports triton. Under TRITON_INTERPRET=1 (set before the import) the kernel runs on
CPU tensors, dotting in float32 (the interpreter's bfloat16 dot is wrong).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_BLOCK_K = 16  # tl.dot's least K
MAX_SPLIT_K = 16


@triton.jit
def _weight_only_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32, rows stride_xm apart
    w_ptr,  # BITS 4: uint8 [N, ceil(K / 2)]; BITS 8: int8 [N, K]; rows stride_wn apart
    scale_ptr,  # float32 [K / GROUP, N]; BITS 8 with GROUP 0 (per channel): float32 [N]
    zero_ptr,  # BITS 4 with HAS_ZERO: float32 [K / GROUP, N]; else unused
    out_ptr,  # SPLIT_K 1: [M, N] in x's dtype; else float32 [SPLIT_K, M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    k_per_split,  # a multiple of BLOCK_K
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUP: tl.constexpr,  # K per scale (BITS 8: 0, one scale per channel)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        if BITS == 4:
            # K is whole groups and BLOCK_K divides GROUP: this step is all of one group, and in bounds.
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=mask_n[:, None], other=0
            )
            q = tl.interleave(packed & 15, packed >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K], k order
            group = k0 // GROUP
            scale = tl.load(scale_ptr + group * N + offs_n, mask=mask_n, other=0.0)
            if HAS_ZERO:
                zero = tl.load(zero_ptr + group * N + offs_n, mask=mask_n, other=0.0)
            else:
                zero = tl.full((BLOCK_N,), 8.0, tl.float32)
            w = ((q - zero[:, None]) * scale[:, None]).to(x_ptr.dtype.element_ty)
        else:
            w = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :],
                other=0,
            )
            if GROUP > 0:  # int8 in groups (GGUF's Q8_0, Q6_K): each step within one group, as int4's
                scale = tl.load(scale_ptr + (k0 // GROUP) * N + offs_n, mask=mask_n, other=0.0)
                w = (w.to(tl.float32) * scale[:, None]).to(x_ptr.dtype.element_ty)
        w = tl.trans(w.to(DOT_DTYPE))
        if IEEE_DOT:
            acc = tl.dot(x.to(DOT_DTYPE), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(DOT_DTYPE), w, acc)
    if BITS == 8 and GROUP == 0:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    block_k: int
    split_k: int  # programs along K (1: none)
    k_per_split: int  # K each of them covers, a multiple of block_k
    num_warps: int
    num_stages: int


def block_k_limit(group_size: int | None) -> int:
    """The largest K step within one group: the power-of-two part of group_size (0 if under 16, which
    this kernel does not serve); int8 (no groups) any."""
    if group_size is None:
        return 1 << 30
    part = group_size & -group_size
    return part if part >= MIN_BLOCK_K else 0


def plan(m: int, n: int, k: int, group_size: int | None, num_sms: int, fp32: bool = False) -> Plan:
    """Tile sizes for an [m, k] x [k, n] product (untuned, see the module docstring), and the split of K
    that lets the output tiles fill num_sms when there are too few of them (decode widths). fp32: x in
    float32, whose ieee dot (no tensor cores) needs smaller tiles."""
    # Warps per tile: the fewest at which ptxas fits the tile without spilling on sm_90 (bfloat16, 4-bit
    # with zero points and int8; tests/unit/triton_linear_compile.py compiles each): 146-214 registers.
    if m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 64, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = max(16, triton.next_power_of_2(m)), 64, 128, 8, 4
    else:
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 8, 3
    if fp32:  # 64 x 128 x 64 spilled 5.8 KB; these at most 8 bytes
        block_n, block_k, stages = 64, 32, 2
    block_k = min(block_k, block_k_limit(group_size), max(MIN_BLOCK_K, triton.next_power_of_2(k)))
    steps = triton.cdiv(k, block_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    if m <= 64 and tiles < num_sms:
        split = min(triton.cdiv(num_sms, tiles), steps, MAX_SPLIT_K)
    steps_per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, steps_per_split)  # none of them empty
    return Plan(block_m, block_n, block_k, split, steps_per_split * block_k, warps, stages)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small test shapes still take the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(x, w, scale, zero, n: int, bits: int, group_size: int | None, plan_: Plan | None):
    if x.dtype not in DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; the Triton weight-only kernel takes {DTYPES}")
    if not INTERPRET and x.device.type != "cuda":
        raise ValueError(f"x is on {x.device}: the Triton kernel needs CUDA, or TRITON_INTERPRET=1 (tests)")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    out_shape = (*x.shape[:-1], n)
    if m == 0 or n == 0:  # nothing to launch (and no tiles to plan)
        return torch.zeros(out_shape, dtype=x.dtype, device=x.device)
    p = plan_ or plan(m, n, k, group_size, _num_sms(x.device), x.dtype == torch.float32)
    if p.split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((p.split_k, m, n), dtype=torch.float32, device=x.device)
    dot_dtype = tl.float32 if INTERPRET or x.dtype == torch.float32 else _TL[x.dtype]
    grid = (triton.cdiv(m, p.block_m) * triton.cdiv(n, p.block_n), p.split_k)
    _weight_only_kernel[grid](
        rows, w, scale, scale if zero is None else zero, out, m, n, k, rows.stride(0), w.stride(0),
        p.k_per_split, BITS=bits, HAS_ZERO=zero is not None, GROUP=group_size or 0, BLOCK_M=p.block_m,
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, DOT_DTYPE=dot_dtype, IEEE_DOT=x.dtype == torch.float32,
        num_warps=p.num_warps, num_stages=p.num_stages,
    )  # fmt: skip
    if p.split_k > 1:
        out = out.sum(0).to(x.dtype)
    return out.reshape(out_shape)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale_t: torch.Tensor,
    zero_t: torch.Tensor | None,
    group_size: int,
    plan_: Plan | None = None,
) -> torch.Tensor:
    """x [..., K] -> x W^T [..., N] in x's dtype. qweight uint8 [N, K / 2] (low nibble: the even k);
    scale_t / zero_t float32 [K / group_size, N] (zero_t None: 8). plan_: tiles (tests), else planned."""
    n, k = qweight.shape[0], x.shape[-1]
    if not serves_groups(group_size, k) or qweight.shape[1] * 2 != k:
        raise ValueError(f"int4: K={k} with group {group_size} and qweight {tuple(qweight.shape)} not served")
    if tuple(scale_t.shape) != (k // group_size, n) or (zero_t is not None and zero_t.shape != scale_t.shape):
        raise ValueError(f"int4: scales must be [{k // group_size}, {n}] float32")
    return _launch(x, qweight, scale_t, zero_t, n, 4, group_size, plan_)


def int8_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    group_size: int | None = None,
    plan_: Plan | None = None,
) -> torch.Tensor:
    """x [..., K] -> x W^T [..., N] in x's dtype, W = q int8 [N, K] times scale float32 [N] per row, or
    with group_size, scale float32 [K / group_size, N] (transposed): w[n, k] = q[n, k] * scale[k // g, n]."""
    n, k = q.shape
    want = (n,) if group_size is None else (k // group_size, n)
    if q.dtype != torch.int8 or k != x.shape[-1] or tuple(scale.shape) != want:
        raise ValueError(
            f"int8: q {q.dtype} {tuple(q.shape)}, scale {tuple(scale.shape)}, x {tuple(x.shape)}"
        )
    if group_size is not None and not serves_groups(group_size, k):
        raise ValueError(f"int8: K={k} in groups of {group_size} not served")
    return _launch(x, q, scale, None, n, 8, group_size, plan_)


def serves_groups(group_size: int, k: int) -> bool:
    """Whether int4_matmul (int8_matmul with groups) takes K in these groups (else the caller dequantizes)."""
    return bool(block_k_limit(group_size)) and k % group_size == 0 and k % 2 == 0
