"""Symmetric int8 in groups along K: w[n, k] = q[n, k] * scale[n, k // g], q in -128..127, float32
scales. What GGUF's Q8_0 (g 32), Q5_0 and Q4_0 (g 32, q - 16 and q - 8) and Q6_K (g 16: its int8
sub-block scale times the fp16 super-block scale, exact in float32) hold exactly (quant/gguf.py).

On a CPU where our linear kernel multiplies int8 (cpu_linear.available), GGUF's layers skip this class:
products.pack_int8 holds them in that kernel's layout with a scale per group (each group summed in
float32, then times its scale): SmolLM2's shapes at groups of 32, one thread, AMD EPYC Zen 4 (AVX-512 BF16,
no AMX), shared machine, bench/cpu_linear.py --int8: 1.22x our bf16 kernel at 1 row, 1.02x at 8, 0.87x at
32, and 1.5x / 3.2x / 3.9x this class. What follows serves the other CPUs (and devices).

The product, chosen by bench/gguf_kernels.py (its header holds the figures):
  g a multiple of 32, N % 16 == 0, on CPU: two 4-bit tinygemm products (PackedInt4,
      aten._weight_int4pack_mm_for_cpu). q + 128 = 16 a + b with a, b in 0..15, so
          w = 16 s (a - 8) + s b
      a PackedInt4 of a (scale 16 s, zero 8) plus one of b (scale s, zero 0), summed. Exact in real
      arithmetic; the kernel rounds x and the scales to bfloat16 as every CPU kernel here does. Held
      as one PackedInt4 of [a | b] (K doubled) multiplied by [x | x]: one call, both halves summed in
      the kernel's float32 accumulator (two calls and an add measured slower).
  otherwise (Q6_K's groups of 16, which tinygemm does not take): q int8 and its scales, multiplied on
      CPU by inductor-compiled code (torch.compile, compiled at the worker's warm-up, kept in its
      compile cache): one row, a fused dequantize-multiply-sum in float32 (0.68-1.41x bf16); more rows,
      a compiled dequantize to bf16 then the bf16 product (0.13-0.53x bf16: eager dequantization was
      0.04-0.37x). Another device or dtype: dequantized per product, then F.linear.
  on CUDA (kernels.TRITON_DEVICES): q as it is and its scales transposed to [K / g, N], through the Triton
      weight-only kernel (quant/triton_linear.py), each K step within one group (g 16 and 32 both served).
Either holds fewer bytes than bf16's 2 a weight: 1.75 as [a | b] (packed nibbles, their float32 scales
and zeros, the kernel's bf16 copies), 1.25 as int8 with per-16 scales. At one row: group 32 1.14-1.52x
bf16's speed, group 16 0.68-1.41x; from 8 rows both lose (0.13-0.95x).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.quant import kernels
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
        n, k = self.shape
        # On CUDA (kernels.TRITON_DEVICES): q as it is through the Triton kernel, scales transposed.
        self.triton = kernels.triton_serves(q.device) and kernels._triton().serves_groups(self.group_size, k)
        self.split = (
            not self.triton and q.device.type == "cpu" and n % 16 == 0 and self.group_size in INT4_GROUPS
        )
        if self.split:  # [a | b] along K, one product of [x | x]: the kernel sums both halves in float32
            u = q.to(torch.int16) + 128
            nibbles = torch.cat([u >> 4, u & 15], dim=1).to(torch.uint8)
            zero = torch.cat([torch.full_like(scale, 8.0), torch.zeros_like(scale)], dim=1)
            scales = torch.cat([16 * scale, scale], dim=1)
            self.halves = h = PackedInt4.pack(nibbles, scales, zero, self.group_size)
            self.q = self.scale = None
            # What the product reads, as plain attributes: built once (a product's Python work measured
            # ~100 us with the caches cold when it went through PackedInt4.matmul).
            kernel_scales = h._scales_and_offsets(torch.bfloat16)
            self._kernel = (h.qweight, h.kernel_group, kernel_scales) if h.tinygemm else None
        else:
            self.halves = self._kernel = None
            self.register_buffer("q", q, persistent=False)
            self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("scale_t", scale.t().contiguous() if self.triton else None, persistent=False)

    @property
    def kernel(self) -> str:
        if self.triton:
            return "triton int8 groups"
        if self.split:
            return f"{self.halves.kernel}, K doubled"  # [a | b] times [x | x]
        return "compiled" if self.q.device.type == "cpu" else "dequantize"

    @property
    def nbytes(self) -> int:
        if self.split:
            return self.halves.nbytes + sum(t.numel() * 2 for t in self.halves._kernel_scales.values())
        return self.q.numel() + 4 * self.scale.numel() * (2 if self.triton else 1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x W^T [..., N] in x.dtype."""
        if self.triton and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return kernels._triton().int8_matmul(x, self.q, self.scale_t, self.group_size)
        if x.dtype not in (torch.float32, torch.bfloat16):
            return F.linear(x, self.dequantize(x.dtype))
        if self.split and self._kernel is None:  # the halves in another kernel's layout (cpu_linear's)
            return self.halves.matmul(torch.cat([x, x], -1))
        if self.split:
            qweight, group, scales = self._kernel
            rows = x.reshape(-1, x.shape[-1])
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                torch.cat([rows, rows], 1).to(torch.bfloat16), qweight, group, scales
            )
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
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
        n, k = self.shape
        hi, lo = self.halves.unpack().to(torch.int16).split(k, dim=1)
        return ((hi << 4) | lo).sub(128).to(torch.int8), self.halves.scale[:, k // self.group_size :]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        q, scale = self.unpack()
        n, k = self.shape
        w = q.view(n, k // self.group_size, self.group_size).float() * scale[..., None]
        return w.view(n, k).to(dtype)

    def _apply(self, fn, recurse=True):
        # The split form is CPU-only (tinygemm's layout): a device move re-places from q and scale.
        q, scale = self.unpack()
        q, scale = fn(q), fn(scale)
        for name in ("halves", "q", "scale", "scale_t"):
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
