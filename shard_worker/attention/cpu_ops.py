"""The small ops of a CPU decode step, from the attention kernel's library (csrc/cpu_small_ops.cpp):
an RMS norm (with the residual add before it), rotary on queries and keys in place, the gated MLP's
silu(gate) * up, a layer's KV write with its attention in one call, and the greedy sampler's argmax.

Why: at batch 1 a SmolLM2 step in bfloat16 ran about 250 torch ops besides its matmuls, each a few
microseconds of dispatch for a few hundred elements (a norm alone was eight: casts both ways, pow, mean,
add, rsqrt and two products). One ctypes call costs about as much as one torch op.

Numerics: each op rounds to the element type where torch rounds when it runs the same computation op by
op, so results equal the unfused ops' bit for bit, except the norm's mean of squares, summed in another
order, and silu's exp, another polynomial. So those two are used for half types only (`fused_norm_dtype`),
where the difference is a rare last-bit rounding: float32 and float64 models keep torch's ops there, and
their outputs stay exactly what they were.

Every function here answers False (or None) when it cannot take its arguments (not CPU, another dtype,
strides it does not handle, no compiler to build the library), and the caller runs the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess

import torch

from shard_worker.attention import cpu_kernel

CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
HALF = (torch.bfloat16, torch.float16)


class StepPlan(ctypes.Structure):
    """What every layer's attention call of one step shares (csrc: struct StepPlan)."""

    _fields_ = [
        ("tokens", ctypes.c_void_p),
        ("seq", ctypes.c_void_p),
        ("pos", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("table", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("table_width", ctypes.c_int64),
        ("fault", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64),
        ("num_threads", ctypes.c_int32),
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel's library with these functions declared; None when it cannot be built or loaded."""
    try:
        lib = cpu_kernel.load()
    except (cpu_kernel.KernelUnavailable, OSError, subprocess.SubprocessError):
        return None
    i, i64, ptr, f = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.tp_rms_norm.argtypes = [i, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f, i, i]
    lib.tp_rotary.argtypes = [i, ptr, i64, i64, i, ptr, i64, i64, i, ptr, ptr, i64, i64, i, i]
    lib.tp_silu_mul.argtypes = [i, ptr, i64, ptr, i64, i64, i]
    lib.tp_argmax.argtypes = [ptr, i64, i64, i64, ptr]
    lib.tp_attention_layer.argtypes = [ptr, i, i, ptr, i64, i64, ptr, i64, ptr, i64, ptr, i64, ptr]
    lib.tp_attention_layer.argtypes += [i, i, i, i, f, f, f, i64, ptr]
    for fn in (lib.tp_rms_norm, lib.tp_rotary, lib.tp_silu_mul, lib.tp_argmax, lib.tp_attention_layer):
        fn.restype = ctypes.c_int
    return lib


def fused_norm_dtype(x: torch.Tensor) -> bool:
    """Whether rms_norm (and silu_mul) take x: a CPU tensor of a half type, 2-D with contiguous rows."""
    return x.dtype in HALF and x.is_cpu and x.dim() == 2 and x.stride(1) == 1


def rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
    gemma: bool = False,
    delta: torch.Tensor | None = None,  # [rows, hidden]: added to x first
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """(x + delta or None without delta, its norm): Llama's norm (weight * round(normalize(h)), normalize
    in float32) or Gemma's (normalize(h) * (1 + weight), all in float32), as new tensors. None when the
    arguments are not taken (see fused_norm_dtype): the caller runs torch's ops."""
    lib = library()
    if lib is None or weight.dtype != x.dtype or weight.shape != (x.shape[1],) or weight.stride(0) != 1:
        return None
    if delta is not None and (delta.dtype != x.dtype or delta.shape != x.shape or delta.stride(1) != 1):
        return None
    # Contiguous rows (empty_like of 2-D rows with a stride of their own is contiguous), at half the cost
    # of torch.empty(shape, dtype=...), a measurable share of a call this small.
    out = torch.empty_like(x)
    total = None if delta is None else torch.empty_like(x)
    rc = lib.tp_rms_norm(
        CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        None if total is None else total.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        int(gemma),
        torch.get_num_threads(),
    )
    return (total, out) if rc == 0 else None


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """q [T, heads, d] and k [T, kv_heads, d] rotated in place by cos and sin ([T, 1, d], their dtype),
    exactly as rotary.apply_rotary computes them; False (nothing done) when the arguments are not taken."""
    code = CODES.get(q.dtype)
    if (
        code is None
        or q.device.type != "cpu"
        or not (q.dtype == k.dtype == cos.dtype == sin.dtype)
        or q.stride(2) != 1
        or k.stride(2) != 1
        or cos.stride(2) != 1
        or cos.stride() != sin.stride()
        or cos.shape[0] != q.shape[0]
        or k.shape[0] != q.shape[0]
        or not (cos.shape[2] == q.shape[2] == k.shape[2])
        or (lib := library()) is None
    ):
        return False
    rc = lib.tp_rotary(
        code,
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        q.shape[1],
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        k.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        q.shape[0],
        q.shape[2],
        torch.get_num_threads(),
    )
    return rc == 0


def silu_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for x's rows [gate | up] ([rows, 2 * inter] -> [rows, inter]), rounded as F.silu
    and the product round them, for a half type on CPU (float32 keeps torch's silu, whose exp differs in
    its last bits); None when x is not taken."""
    if not fused_norm_dtype(x) or x.shape[1] % 2 or (lib := library()) is None:
        return None
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype)
    rc = lib.tp_silu_mul(
        CODES[x.dtype], x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], inter, torch.get_num_threads()
    )
    return out if rc == 0 else None


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """x.argmax(dim=-1) of float32 CPU rows [rows, cols] (the same index, ties and NaN included), about
    twenty times faster than torch's at a 49k vocabulary; None when x is not taken."""
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.stride(1) != 1 or not x.shape[1]:
        return None
    if (lib := library()) is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = lib.tp_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out if rc == 0 else None
