"""The KV cache's element type (--kv-cache-dtype, vLLM's names): what a store rounds to, what a read
upcasts from.

Keys and values are computed in the model's dtype, rounded to the cache's when stored (fp8: divided by the
layer's scale first, and saturated to the format's range rather than turned into NaN), and read back in
the model's dtype (fp8: times the scale). Attention itself runs in the model's dtype. CPU has no indexed
copy for fp8 types, so fp8 slots are copied as their bytes.
"""

from __future__ import annotations

import torch

from shard_worker.config import KV_CACHE_DTYPES

_TORCH = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype: auto is the model's."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return model_dtype if name == "auto" else _TORCH[name]


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes for an fp8 tensor (for indexed copies, which CPU lacks for fp8)."""
    return t.view(torch.uint8) if t.dtype in FP8 else t


def store(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x rounded to the cache's dtype (x itself when they are the same)."""
    if x.dtype == dtype:
        return x
    if dtype in FP8:
        limit = torch.finfo(dtype).max
        x = (x / scale if scale != 1.0 else x).clamp(-limit, limit)
    return x.to(dtype)


def load(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache contents in the model's dtype (x itself when they are the same)."""
    if x.dtype == dtype:
        return x
    # Only fp8 stores divided by the scale (store above); a bf16 cache holds the values themselves.
    fp8 = x.dtype in FP8
    x = x.to(dtype)
    return x * scale if fp8 and scale != 1.0 else x
