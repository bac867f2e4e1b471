"""Attention backends, one chosen when the worker starts (`--attention-backend`).

- cpu: a C++ paged kernel of our own for decodes, SDPA for prefill chunks; CPU float32, bfloat16 and
  float16, any KV cache dtype (cpu.py).
- flex: torch's compiled flex_attention over the paged cache, CPU float32 (flex.py).
- reference: one sequence at a time in plain torch; any device and dtype, exact (reference.py).
- triton: a paged-attention kernel for CUDA (triton_paged.py).
auto picks triton on CUDA, cpu on CPU in float32/bfloat16/float16 (flex for float32 where the kernel
cannot be built: no C++ compiler), and the reference otherwise (float64, which the end-to-end tests
compare with transformers in).
Multi-head latent attention layers (DeepSeek-V3) attend in torch through latent.py under cpu, flex and
reference, which give it the step's block tables; triton refuses them at start-up.
"""

from __future__ import annotations

import torch

from shard_worker.attention.backend import AttentionBackend, AttentionContext, StepBatch
from shard_worker.attention.layer import Attention

BACKEND_NAMES = ("auto", "cpu", "flex", "triton", "reference")

__all__ = ["Attention", "AttentionBackend", "AttentionContext", "StepBatch", "select_backend"]


def _backend_class(name: str) -> type[AttentionBackend]:
    if name == "cpu":
        from shard_worker.attention.cpu import CpuBackend

        return CpuBackend
    if name == "flex":
        from shard_worker.attention.flex import FlexBackend

        return FlexBackend
    if name == "reference":
        from shard_worker.attention.reference import ReferenceBackend

        return ReferenceBackend
    if name == "triton":
        from shard_worker.attention.triton_paged import TritonBackend

        return TritonBackend
    raise ValueError(f"--attention-backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")


def auto_backend_name(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return "triton"
    if dtype == torch.float64:
        return "reference"
    if _backend_class("cpu").unsupported(device, dtype) is None:
        return "cpu"
    return "flex" if dtype == torch.float32 else "reference"


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend to run; ValueError in one line when the named one cannot run here."""
    if name == "auto":
        name = auto_backend_name(device, dtype)
    cls = _backend_class(name)
    reason = cls.unsupported(device, dtype)
    if reason is not None:
        raise ValueError(f"--attention-backend {name}: {reason}")
    return cls(device, dtype)
