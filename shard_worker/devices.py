"""What a machine must offer the shard workers it runs: the rules, as plain functions of what torch
reports, so they are tested without a GPU. Each raises ValueError naming the flag it refuses.

Which dtypes each device runs (torch 2.13): on CPU all four of config.DTYPES, float16 and bfloat16
matmuls included; on CUDA float32, float16 and float64 on any GPU torch supports, bfloat16 only where the
GPU has it natively (Ampere and later; torch would otherwise emulate it, many times slower).
"""

from __future__ import annotations


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


def check_dtype(device_type: str, dtype: str, native_bf16: bool) -> None:
    """Refuses a dtype the device does not run natively (see the module's note)."""
    if device_type == "cuda" and dtype == "bfloat16" and not native_bf16:
        raise ValueError("--dtype bfloat16: this GPU has no native bfloat16 support (use --dtype float16)")
