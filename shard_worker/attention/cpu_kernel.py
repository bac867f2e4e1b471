"""The CPU paged-attention kernel (csrc/cpu_paged_attention.cpp): built once per machine, called through
ctypes.

The source is plain C++ with OpenMP and no torch headers, so it builds in about a second with the
system's C++ compiler (`$CXX`, else g++ or c++), with -march=native: the CPU it runs on decides its
vector width (AVX2 or AVX-512). The library is kept in the worker's compile cache (TORCHINDUCTOR_CACHE_DIR,
set from --compile-cache-dir by shard_worker/startup.py) under a name that hashes the source, the compiler,
the flags and the CPU's feature flags, so a restart loads it and a different node builds its own. Several
ranks building at once each write a private file and rename it into place.

OpenMP: the library links libgomp.so.1, which resolves to the copy torch has already loaded (same soname),
so the kernel and torch's own parallel regions share one thread pool instead of two competing ones.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
ABI = 1

DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 1024


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here (no compiler, a failed build); the message says why."""


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.expanduser("~/.cache/tpserve/compile")
    return Path(root) / "tpserve_cpu_attention"


def library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
    return _cache_dir() / f"cpu_paged_attention_{key.hexdigest()[:16]}.so"


def build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", scratch], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-400:]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


@functools.cache
def load() -> ctypes.CDLL:
    """The kernel's library, built first if this machine has none yet. KernelUnavailable when it cannot
    be (cached: one attempt per process)."""
    compiler = _compiler()
    if compiler is None:
        raise KernelUnavailable("no C++ compiler ($CXX, g++ or c++) to build the CPU attention kernel")
    path = library_path(compiler)
    if not path.exists():
        build(compiler, path)
    lib = ctypes.CDLL(str(path))
    if lib.tp_paged_attention_abi() != ABI:
        raise KernelUnavailable(f"{path} is another version of the kernel")
    fn = lib.tp_paged_attention
    i, i64, ptr, f = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [i, i, ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64]
    fn.argtypes += [i, i, i, i, f, f, f, i64, i]
    fn.restype = ctypes.c_int
    return lib


def unavailable() -> str | None:
    """Why the kernel cannot run here, in one line; None when it can (building it if needed)."""
    try:
        load()
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


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
) -> None:
    """Each selected token attended over keys max(0, p - window + 1) .. p of its sequence (p its
    position), in float32 arithmetic, written into out. The cache must already hold this step's keys."""
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
    if kv_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        k_scale = v_scale = 1.0  # only fp8 caches hold scaled values (kv_dtype.store)
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
    )
    if rc != 0:
        raise ValueError(f"the CPU attention kernel refused its arguments (code {rc})")
