"""The quantized products and quantization rules that more than one format uses.

Rules (what an online quantization computes, and what a test quantizing offline must compute too):
    int8, symmetric per output channel: scale = amax(|w_row|) / 127, q = round(w / scale)
    fp8 e4m3, per output channel (or per tensor): scale = amax / 448, q = (w / scale) in e4m3
Dynamic activations (W8A8): per token, scale = amax(|x_row|) / 127 (int8) or / 448 (fp8), vLLM's rule.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.quant import cpu_linear
from shard_worker.model.quant.int8_groups import PackedInt8Groups
from shard_worker.model.quant.kernels import PackedInt8

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# Float dtypes the weight-only kernels take (quant/kernels.py); others (float64 tests, float16) run
# their reference: dequantize, then F.linear.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _amax(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    a = w.abs().amax(dim=-1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    return a.float().clamp(min=torch.finfo(torch.float32).tiny)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale float32 [N])."""
    scale = _amax(w, True) / 127.0
    q = torch.round(w.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.reshape(-1)


def quantize_fp8(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [N, K], scale float32 [N] or [1])."""
    scale = _amax(w, per_channel) / FP8_MAX
    q = (w.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] times a scale per row ([N]) or for all ([1])."""
    return (q.to(torch.float32) * scale.reshape(-1, 1)).to(dtype)


def weight_only(packed, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A PackedInt8 / PackedInt4 product; other float dtypes through the dequantized weight."""
    # On CUDA every dtype goes to matmul, which knows what its Triton kernel takes (float16 too).
    kernel = x.dtype in KERNEL_DTYPES or x.device.type == "cuda"
    y = packed.matmul(x) if kernel else F.linear(x, packed.dequantize(x.dtype))
    return y if bias is None else y + bias


def pack_int8(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, w8a8: bool = False) -> None:
    """Holds an int8 layer's q (int8 [N, K]) and scale (float32 [N], or [N, K / g] for groups of g k:
    GGUF's Q8_0, g 32) for its device's kernel: on a CPU where our linear kernel multiplies int8
    (cpu_linear.available; W8A8: available_w8a8), in its layout, which the layer's `weight` parameter holds
    (`layer.cpu_packed` describes it, `weight_scale` is its scale), as the unquantized method holds bf16
    weights; else as kernels.PackedInt8 (`layer.packed`: aten._weight_int8pack_mm on CPU, fbgemm for W8A8)
    or int8_groups.PackedInt8Groups. w8a8: x quantized per token for the product (compressed-tensors
    W8A8). After the layer's tensor-parallel shard has loaded."""
    group = q.shape[1] // scale.shape[1] if scale.dim() == 2 else 0
    fits = group % 2 == 0 and 2048 % max(group, 1) == 0  # what the kernel takes (GGUF's 16 and 32 do)
    cpu = q.device.type == "cpu"
    if w8a8 and cpu and cpu_linear.available_w8a8():
        layer.cpu_packed = cpu_linear.PackedLinear.pack_w8a8(q, scale)
    elif not w8a8 and cpu and cpu_linear.available(torch.int8) and fits:
        layer.cpu_packed = cpu_linear.PackedLinear.pack(q, scale=scale)
    elif group:
        layer.packed = PackedInt8Groups.pack(q, scale, group)
        return
    else:
        layer.packed = PackedInt8.pack(q, scale)
        return
    layer.register_parameter("weight", nn.Parameter(layer.cpu_packed.data, requires_grad=False))
    layer.register_parameter("weight_scale", nn.Parameter(layer.cpu_packed.scale, requires_grad=False))


def int8_product(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for a layer packed by pack_int8, in x's dtype (a W8A8 one held as PackedInt8 is the
    caller's: PackedInt8.matmul_dynamic)."""
    packed = getattr(layer, "cpu_packed", None)
    if packed is None:
        return weight_only(layer.packed, x, bias)
    if x.dtype in cpu_linear.X_CODES and x.device.type == "cpu":
        return cpu_linear.linear(x, packed, bias)
    # Another dtype (float64 tests): the same rule in torch, correct and slow.
    if packed.code == cpu_linear.W8A8:
        y = PackedInt8.pack(packed.unpack(), packed.scales()).matmul_dynamic(x)
    else:
        y = F.linear(x, packed.dequantize(x.dtype))
    return y if bias is None else y + bias


def round_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 per token (scale amax / 448 per row) and back to its dtype: a W8A8 fp8
    checkpoint's activations, as its producer calibrated them."""
    x2 = x.reshape(-1, x.shape[-1])
    sx = _amax(x2, True) / FP8_MAX
    return ((x2.float() / sx).clamp_(-FP8_MAX, FP8_MAX).to(FP8).float() * sx).to(x.dtype).reshape(x.shape)


def round_fp8_by(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 by one scale for all rows (per-tensor activations) and back to its dtype."""
    return ((x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * x_scale).to(x.dtype)


def scaled_mm_serves(device_type: str, capability: tuple[int, int] | None, n: int, k: int) -> bool:
    """Whether an e4m3 [N, K] weight is multiplied by torch._scaled_mm: on CUDA with fp8 tensor cores
    (compute capability 8.9: Ada, 9.0: Hopper, and later) when N and K are multiples of 16 (what
    cuBLASLt's fp8 GEMM requires); else it is dequantized per product (fp8_linear)."""
    return device_type == "cuda" and capability is not None and capability >= (8, 9) and n % 16 == 0 == k % 16


@functools.cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def fp8_scaled_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias, x_scale=None) -> torch.Tensor:
    """W8A8 through torch._scaled_mm: each row of x quantized to e4m3 by its own absmax / 448 (or by
    x_scale, one scalar for all rows: a per-tensor checkpoint's activations), then the fp8 product with
    float32 sums, scaled by the row's scale and the weight's per-row scale [N]. Both scales go in rowwise
    ([M, 1] and [1, N] float32, contiguous: besides one scalar each, the only pairing _scaled_mm takes),
    and the output is bfloat16 (the one type every torch version's rowwise path writes), cast to x's.
    q e4m3 [N, K] row-major, so q.t() is the column-major operand cuBLASLt wants. Runs on CPU too
    (torch's reference fp8 GEMM, checks the same shapes): what tests/unit/test_fp8_scaled_mm.py runs."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if x_scale is None:
        x_scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    else:
        x_scale = x_scale.float().reshape(1, 1).expand(rows.shape[0], 1).contiguous()
    xq = (rows / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    w_scale = scale.float().reshape(1, -1).contiguous()
    y = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    y = y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias, dynamic_act: bool, x_scale=None):
    """x W^T with W = q * scale (e4m3, scale per row [N]). Where scaled_mm_serves (CUDA with fp8 tensor
    cores): fp8_scaled_mm, activations quantized per token (or by x_scale) whatever dynamic_act says,
    as vLLM's online fp8 does: a weight-only checkpoint runs W8A8 there. Elsewhere by dequantizing W to
    x's dtype. dynamic_act: x is first rounded to e4m3 per token (a W8A8 checkpoint's activations, as
    its producer calibrated it); x_scale: by one scale for all rows (per-tensor activations)."""
    if scaled_mm_serves(q.device.type, _capability(q.device), q.shape[0], q.shape[1]):
        return fp8_scaled_mm(x, q, scale, bias, x_scale)
    if x_scale is not None:
        x = round_fp8_by(x, x_scale)
    elif dynamic_act:
        x = round_fp8_per_token(x)
    return F.linear(x, dequantize(q, scale, x.dtype), bias)


def pack_fp8(layer: nn.Module, name: str) -> None:
    """On a CPU where our linear kernel takes e4m3 weights (cpu_linear.available), holds the layer's
    e4m3 weight `name` ([N, K]) and its `weight_scale` (float32 [N]) in that kernel's layout (the int8
    one, the bytes widened exactly to bf16 or float32 in registers): `layer.cpu_packed`, whose bytes the
    parameter then holds. Elsewhere the weight stays as it is (fp8_linear)."""
    q = getattr(layer, name)
    if q.device.type != "cpu" or not cpu_linear.available(FP8):
        return
    layer.cpu_packed = cpu_linear.PackedLinear.pack(q.detach(), scale=layer.weight_scale.detach().reshape(-1))
    layer.register_parameter(name, nn.Parameter(layer.cpu_packed.data, requires_grad=False))
    layer.register_parameter("weight_scale", nn.Parameter(layer.cpu_packed.scale, requires_grad=False))


def fp8_product(
    layer: nn.Module, x: torch.Tensor, name: str, bias, dynamic_act: bool, x_scale=None
) -> torch.Tensor:
    """x W^T + b for an e4m3 layer (pack_fp8): our kernel where it holds the weight, else fp8_linear
    (torch._scaled_mm on CUDA with fp8). x_scale: one activation scale for all rows (per tensor)."""
    packed = getattr(layer, "cpu_packed", None)
    if packed is None or x.dtype not in cpu_linear.X_CODES:
        q = getattr(layer, name) if packed is None else packed.unpack()
        return fp8_linear(x, q, layer.weight_scale, bias, dynamic_act, x_scale)
    if x_scale is not None:
        x = round_fp8_by(x, x_scale)
    elif dynamic_act:
        x = round_fp8_per_token(x)
    return cpu_linear.linear(x, packed, bias)
