"""Weight-only int8 and int4 products: the API the quantized methods code against.

This is the REFERENCE implementation (dequantize, then F.linear), correct on every device; the fast CPU
kernels replace this file behind the same API. TP slicing happens before pack: pack takes this rank's
shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedInt8:
    """Weight-only int8, symmetric, per output channel: w = q * scale."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale

    @classmethod
    def pack(cls, q: torch.Tensor, scale: torch.Tensor) -> PackedInt8:
        """q: int8 [N, K]; scale: float [N]."""
        return cls(q.to(torch.int8).contiguous(), scale.reshape(-1).float().contiguous())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (float32 or bfloat16) -> [..., N] in x's dtype."""
        return F.linear(x, self.dequantize(x.dtype))


class PackedInt4:
    """Weight-only 4-bit in groups of group_size along K: w = (q - zero) * scale."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int):
        self.q, self.scale, self.zero, self.group_size = q, scale, zero, group_size

    @classmethod
    def pack(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
    ) -> PackedInt4:
        """q: uint8 values 0..15 [N, K]; scale: float [N, K // group_size]; zero: float of the same shape,
        or None for symmetric (zero 8)."""
        n, k = q.shape
        if k % group_size or scale.shape != (n, k // group_size):
            shape = tuple(scale.shape)
            raise ValueError(f"PackedInt4: scale {shape} does not fit [{n}, {k}] in groups of {group_size}")
        zero = torch.full_like(scale, 8.0, dtype=torch.float32) if zero is None else zero.float()
        return cls(q.to(torch.uint8).contiguous(), scale.float().contiguous(), zero.contiguous(), group_size)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        g = self.group_size
        scale = self.scale.repeat_interleave(g, dim=1)
        zero = self.zero.repeat_interleave(g, dim=1)
        return ((self.q.float() - zero) * scale).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))
