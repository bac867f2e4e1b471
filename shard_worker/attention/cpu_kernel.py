"""The CPU paged-attention kernel (csrc/cpu_paged_attention.cpp): built once per machine by
shard_worker/cpu_ext.py (-march=native, kept in the compile cache under a hash of source, compiler, flags
and CPU), called through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from shard_worker import cpu_ext
from shard_worker.cpu_ext import KernelUnavailable

CSRC = Path(__file__).with_name("csrc")
EXT = cpu_ext.Extension(
    "cpu_attention",
    CSRC / "cpu_paged_attention.cpp",
    "tp_paged_attention_abi",
    3,
    "the CPU attention kernel",
    more=(CSRC / "cpu_small_ops.cpp", CSRC / "cpu_kernels.h"),
)

DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 1024

__all__ = ["EXT", "KernelUnavailable", "check", "load", "new_fault", "paged_attention", "unavailable"]


@functools.cache
def load() -> ctypes.CDLL:
    """The kernel's library with its signature bound, built first if this machine has none yet.
    KernelUnavailable when it cannot be (one attempt per process)."""
    lib = EXT.load()
    fn = lib.tp_paged_attention
    i, i64, ptr, f = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [i, i, ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64]
    fn.argtypes += [i, i, i, i, f, f, f, i64, i, i64, i64, i64, ptr, ptr]
    fn.restype = ctypes.c_int
    return lib


def unavailable() -> str | None:
    """Why the kernel cannot run here, in one line; None when it can (building it if needed)."""
    return EXT.unavailable()


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    out: torch.Tensor,  # like q: rows `tokens` are written
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    tokens: torch.Tensor,  # [n] int64 step rows to compute
    seq: torch.Tensor,  # [n] int64 their sequences (rows of block_table)
    positions: torch.Tensor,  # [n] int64 their positions
    block_table: torch.Tensor,  # [S, max_blocks] int32
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H] float32 contiguous: gpt-oss's per-head sink logits
) -> None:
    """Each selected token attended over keys max(0, p - window + 1) .. p of its sequence (p its
    position), in float32 arithmetic, written into out; with sinks, each head's sink logit is one more
    term of its softmax's denominator. The cache must already hold this step's keys.
    Every block id read is checked against the cache and every position against the table's width:
    ValueError naming the batch row and the id (check) rather than a read outside them."""
    n = tokens.shape[0]
    if n == 0:
        return
    _, _, block_size, kv_heads, d = kv_cache.shape
    heads = q.shape[1]
    if q.stride(2) != 1 or out.stride(2) != 1 or out.dtype != q.dtype or not kv_cache.is_contiguous():
        raise ValueError("q and out: one dtype, contiguous last dimensions; the cache contiguous")
    if not (block_table.dtype == torch.int32 and block_table.stride(1) == 1):
        raise ValueError("the block table must be int32 with contiguous rows")
    for t in (tokens, seq, positions):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError("tokens, seq and positions must be contiguous int64")
    if sinks is not None and not (
        sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.shape == (heads,)
    ):
        raise ValueError(f"sinks must be contiguous float32 of shape ({heads},)")
    if kv_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        k_scale = v_scale = 1.0  # only fp8 caches hold scaled values (kv_dtype.store)
    fault = new_fault()
    rc = load().tp_paged_attention(
        DTYPE_CODES[q.dtype],
        DTYPE_CODES[kv_cache.dtype],
        q.data_ptr(),
        out.data_ptr(),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        kv_cache.stride(1),
        kv_cache.stride(2),
        tokens.data_ptr(),
        seq.data_ptr(),
        positions.data_ptr(),
        n,
        block_table.data_ptr(),
        block_table.stride(0),
        heads,
        kv_heads,
        d,
        block_size,
        scale,
        k_scale,
        v_scale,
        window or 0,
        torch.get_num_threads(),
        block_table.shape[0],
        block_table.shape[1],
        kv_cache.shape[1],
        fault.data_ptr(),
        sinks.data_ptr() if sinks is not None else None,
    )
    check(rc, fault, kv_cache.shape[1])


def new_fault() -> torch.Tensor:
    """Where the kernel says what it refused: {batch row, block column, block id or the table's width}."""
    return torch.zeros(3, dtype=torch.int64)


def check(rc: int, fault: torch.Tensor, num_blocks: int) -> None:
    """Raises ValueError for a non-zero return code of the kernel, naming what it refused."""
    if rc == 0:
        return
    row, column, value = fault.tolist()
    if rc == -5:
        raise ValueError(
            f"batch row {row}: block id {value} (its block {column}) is outside the KV cache's "
            f"{num_blocks} blocks"
        )
    if rc == -6:
        raise ValueError(
            f"batch row {row}: a position needs its block {column}, the block table holds {value}"
        )
    if rc == -7:
        raise ValueError(f"batch row {row} is not in the block table's {value} rows")
    raise ValueError(f"the CPU attention kernel refused its arguments (code {rc})")
