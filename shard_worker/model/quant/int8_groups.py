"""Symmetric int8 in groups along K: w[n, k] = q[n, k] * scale[n, k // g], q in -128..127, float32
scales. What GGUF's Q8_0 (g 32), Q5_0 and Q4_0 (g 32, q - 16 and q - 8) and Q6_K (g 16: its int8
sub-block scale times the fp16 super-block scale, exact in float32) hold exactly (quant/gguf.py).

The product, chosen by bench/gguf_kernels.py (its header holds the figures):
  g a multiple of 32, N % 16 == 0, on CPU: two 4-bit tinygemm products (PackedInt4,
      aten._weight_int4pack_mm_for_cpu). q + 128 = 16 a + b with a, b in 0..15, so
          w = 16 s (a - 8) + s b
      a PackedInt4 of a (scale 16 s, zero 8) plus one of b (scale s, zero 0), summed. Exact in real
      arithmetic; the kernel rounds x and the scales to bfloat16 as every CPU kernel here does. At batch
      1 on the AVX-512-BF16 EPYC: 1.5-2.7x the bf16 prepacked linear; from 8 rows up 0.2-1.1x (the
      tinygemm cost grows with the rows, as PackedInt4's alone).
  otherwise (Q6_K's groups of 16, which tinygemm does not take): q int8 and its scales, multiplied on
      CPU by inductor-compiled code (torch.compile, compiled at the worker's warm-up, kept in its
      compile cache): one row, a fused dequantize-multiply-sum in float32 (0.85-1.16x bf16); more rows,
      a compiled dequantize to bf16 then the bf16 product (0.4-0.6x bf16: eager dequantization was
      0.1-0.4x). Another device or dtype: dequantized per product, then F.linear.
Either holds fewer bytes than bf16: ~1.6 bytes a weight as two PackedInt4 (packed nibbles, their
float32 scales / zeros and the kernel's bf16 copies), 1.25 as int8 with per-16 scales.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.quant.kernels import INT4_GROUPS, PackedInt4


class PackedInt8Groups(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.shape = tuple(q.shape)
        self._place(q, scale)

    @classmethod
    def pack(cls, q: torch.Tensor, scale: torch.Tensor, group_size: int) -> PackedInt8Groups:
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"PackedInt8Groups wants int8 [N, K], got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if group_size <= 0 or k % group_size:
            raise ValueError(f"PackedInt8Groups: K={k} is not a multiple of group_size {group_size}")
        if tuple(scale.shape) != (n, k // group_size):
            raise ValueError(f"PackedInt8Groups: scale must be {(n, k // group_size)}")
        return cls(q.contiguous(), scale.to(device=q.device, dtype=torch.float32).contiguous(), group_size)

    def _place(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        n, _ = self.shape
        self.split = q.device.type == "cpu" and n % 16 == 0 and self.group_size in INT4_GROUPS
        if self.split:
            u, g = q.to(torch.int16) + 128, self.group_size
            self.hi = PackedInt4.pack((u >> 4).to(torch.uint8), 16 * scale, None, g)
            self.lo = PackedInt4.pack((u & 15).to(torch.uint8), scale, torch.zeros_like(scale), g)
            self.q = self.scale = None
        else:
            self.hi = self.lo = None
            self.register_buffer("q", q, persistent=False)
            self.register_buffer("scale", scale, persistent=False)

    @property
    def kernel(self) -> str:
        if self.split:
            return "weight_int4pack_mm_for_cpu x2"
        return "compiled" if self.q.device.type == "cpu" else "dequantize"

    @property
    def nbytes(self) -> int:
        if self.split:
            kernel_scales = sum(t.numel() * 2 for p in (self.hi, self.lo) for t in p._kernel_scales.values())
            return self.hi.nbytes + self.lo.nbytes + kernel_scales
        return self.q.numel() + 4 * self.scale.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x W^T [..., N] in x.dtype."""
        if x.dtype not in (torch.float32, torch.bfloat16) or (self.split and not self.hi.tinygemm):
            return F.linear(x, self.dequantize(x.dtype))
        if self.split:
            return self.hi.matmul(x) + self.lo.matmul(x)
        if self.q.device.type != "cpu":
            return F.linear(x, self.dequantize(x.dtype))
        rows = x.reshape(-1, x.shape[-1])
        gemv, dequantize_bf16 = _compiled()
        if rows.shape[0] == 1:
            y = gemv(rows.float(), self.q, self.scale)
        else:
            y = F.linear(rows.to(torch.bfloat16), dequantize_bf16(self.q, self.scale))
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale float32 [N, K / g]) as given to pack."""
        if not self.split:
            return self.q, self.scale
        u = (self.hi.unpack().to(torch.int16) << 4) | self.lo.unpack().to(torch.int16)
        return (u - 128).to(torch.int8), self.lo.scale

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        q, scale = self.unpack()
        n, k = self.shape
        w = q.view(n, k // self.group_size, self.group_size).float() * scale[..., None]
        return w.view(n, k).to(dtype)

    def _apply(self, fn, recurse=True):
        # The split form is CPU-only (tinygemm's layout): a device move re-places from q and scale.
        q, scale = self.unpack()
        q, scale = fn(q), fn(scale)
        for name in ("hi", "lo", "q", "scale"):
            delattr(self, name)
        self._place(q, scale)
        return self


def _grouped(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.view(n, scale.shape[1], -1) * scale[..., None]).view(n, k)


def _gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [1, K] float32 -> [1, N]: a reduction inductor fuses with the dequantization (q read once)."""
    return (x[:, None, :] * _grouped(q, scale)[None]).sum(-1)


def _dequantize_bf16(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _grouped(q, scale).to(torch.bfloat16)


@functools.cache
def _compiled():
    # Static shapes: a graph per layer shape (a model has a few), each compiled in ~1 s after the first.
    return torch.compile(_gemv, dynamic=False), torch.compile(_dequantize_bf16, dynamic=False)
