"""What a machine must offer the shard workers it runs: the rules, as plain functions of what torch
reports, so they are tested without a GPU. Each raises ValueError naming the flag it refuses.

Which dtypes each device runs (torch 2.13): on CPU all four of config.DTYPES, float16 and bfloat16
matmuls included; on CUDA float32, float16 and float64 on any GPU torch supports, bfloat16 only where the
GPU has it natively (Ampere and later; torch would otherwise emulate it, many times slower).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def check_cuda_devices(ranks_on_host: int, devices: int) -> None:
    """Every rank of a group on one host needs a CUDA device of its own: NCCL refuses two ranks on one.

    A worker alone cannot know where the other ranks run (one rank per pod in Kubernetes), so it checks
    ranks_on_host 1; `tpserve launch` starts the whole group on this host and checks --tp.
    """
    if devices == 0:
        raise ValueError("--device cuda: no CUDA device is available on this machine")
    if ranks_on_host > devices:
        raise ValueError(
            f"--tp {ranks_on_host}: needs {ranks_on_host} CUDA devices (one per rank), "
            f"this machine has {devices}"
        )


def cuda_index(rank: int, devices: int) -> int:
    """The CUDA device rank takes: its own when the group shares the host, cuda:0 when alone on it."""
    return rank % devices


def model_dtype(
    choice: str, device_type: str, cpu_flags: frozenset[str], cuda_native_bf16: bool
) -> tuple[str, str]:
    """--dtype as (the dtype, why): the choice itself, or for auto the fast type on this machine (vLLM's
    rule, and `tpserve launch`'s default): bfloat16 on a CPU that multiplies it natively (AVX-512 BF16 or
    AMX: weights, activations and KV cache in bf16, attention in the cpu kernel) and on a GPU that has it,
    float16 on an older GPU, and float32 on a CPU without native bf16 (AVX2 only), where bf16 products are
    emulated and slower than float32. An explicit dtype is exactly that dtype, everywhere in the model."""
    if choice != "auto":
        return choice, "asked for"
    if device_type == "cuda":
        if cuda_native_bf16:
            return "bfloat16", "this GPU has native bfloat16"
        return "float16", "this GPU has no native bfloat16"
    native = sorted(cpu_flags & NATIVE_BF16_CPU_FLAGS)
    if native:
        return "bfloat16", f"this CPU multiplies bfloat16 natively ({', '.join(native)})"
    return "float32", "this CPU has no native bfloat16 products (no avx512_bf16 or amx_bf16)"


def check_dtype(device_type: str, dtype: str, native_bf16: bool) -> None:
    """Refuses a dtype the device does not run natively (see the module's note)."""
    if device_type == "cuda" and dtype == "bfloat16" and not native_bf16:
        raise ValueError("--dtype bfloat16: this GPU has no native bfloat16 support (use --dtype float16)")


# /proc/cpuinfo flags of x86 CPUs that multiply bfloat16 natively (oneDNN's bf16 kernels use them).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags (Linux; empty elsewhere)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def linear_dtype(choice: str, dtype: str) -> str | None:
    """The dtype linear layers hold their weights in for --linear-dtype choice, None for --dtype's.

    bfloat16 is an explicit opt-in only (a float32 model with bf16 products is neither float32 nor
    bf16: --dtype auto is the fast choice), so the default, dtype, keeps every layer in --dtype.
    """
    if choice == "bfloat16" and dtype != "bfloat16":
        return "bfloat16"
    return None


def usable_cores(
    affinity: int | None = None, cgroup_root: str = "/sys/fs/cgroup", cgroup_file: str = "/proc/self/cgroup"
) -> int:
    """The cores this process may use: the CPUs it may run on (a cpuset, taskset), capped by its CPU
    quota rounded up (a container's limit: cgroup v2 cpu.max, or v1 cpu.cfs_quota_us / cfs_period_us).
    os.cpu_count() counts the host's: a worker limited to 4 CPUs of a 64-core Kubernetes node would start
    63 threads, throttled at every barrier of every op (on this 2-core machine one busy core already made
    every step of 2 threads 5-8x slower)."""
    cores = affinity if affinity is not None else len(os.sched_getaffinity(0))
    quota = _cgroup_quota(Path(cgroup_root), Path(cgroup_file))
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)


def _cgroup_quota(root: Path, cgroup_file: Path) -> float | None:
    """CPUs' worth of this process's cgroup quota; None when unlimited or unknown."""
    try:
        entries = [
            line.split(":", 2) for line in cgroup_file.read_text().splitlines() if line.count(":") >= 2
        ]
    except OSError:
        entries = []
    for hierarchy, controllers, path in entries:
        if hierarchy == "0":  # v2: cpu.max is "max PERIOD" or "QUOTA PERIOD"
            quota = _read(root / path.lstrip("/") / "cpu.max") or _read(root / "cpu.max")
            if quota and quota.split()[0] != "max":
                return int(quota.split()[0]) / int(quota.split()[1])
        elif "cpu" in controllers.split(","):  # v1: a quota of -1 is none
            for base in (
                root / "cpu,cpuacct" / path.lstrip("/"),
                root / "cpu" / path.lstrip("/"),
                root / "cpu",
            ):
                us, period = _read(base / "cpu.cfs_quota_us"), _read(base / "cpu.cfs_period_us")
                if us and period:
                    return None if int(us) <= 0 else int(us) / int(period)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
