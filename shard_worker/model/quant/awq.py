"""AWQ's GEMM checkpoint layout (AutoAWQ `version: "gemm"`, 4-bit, zero points), to and from the
(q, scale, zero) form PackedInt4 takes. Pure functions on tensors.

On disk, for a linear layer y = x W^T with W [N, K] (N output features, K input features), group g:
    qweight  int32 [K, N / 8]      eight 4-bit values per int32 along N; nibble i (bits 4i..4i+3) of
                                   packed column j holds output column 8j + AWQ_ORDER[i]
    qzeros   int32 [K / g, N / 8]  the groups' zero points, packed the same way (no offset)
    scales   fp16  [K / g, N]
    w[n, k] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]
(AutoAWQ's WQLinear_GEMM.from_linear packs with order_map [0, 2, 4, 6, 1, 3, 5, 7]; its dequantizer
reverses it with [0, 4, 1, 5, 2, 6, 3, 7].)
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS  # values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its eight
# Column c of an eight is in nibble AWQ_NIBBLE_OF_COLUMN[c].
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(c) for c in range(PACK))


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's interleaved order -> uint8 [R, C]."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32)[..., None] >> shifts) & 15  # [R, C / 8, nibble]
    order = torch.tensor(AWQ_NIBBLE_OF_COLUMN, device=packed.device)
    return nibbles[..., order].reshape(packed.shape[0], -1).to(torch.uint8)


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """uint8/int [R, C] with values 0..15 (C a multiple of 8) -> int32 [R, C / 8], AWQ's order."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"AWQ packs eight columns per int32; {cols} columns")
    eights = values.to(torch.int64).reshape(rows, cols // PACK, PACK)[..., list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64, device=values.device)
    words = (eights << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors -> (q uint8 [N, K], scale float32 [N, K / g], zero float32 [N, K / g])."""
    k = qweight.shape[0]
    if k % group_size or qzeros.shape[0] != k // group_size or scales.shape[0] != k // group_size:
        raise ValueError(
            f"AWQ shapes: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
            f"{tuple(scales.shape)} do not agree with group_size {group_size}"
        )
    q = unpack_columns(qweight).t().contiguous()
    zero = unpack_columns(qzeros).t().float().contiguous()
    if zero.shape != (q.shape[0], k // group_size) or scales.shape[1] != q.shape[0]:
        raise ValueError(f"AWQ shapes: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)}")
    return q, scales.t().float().contiguous(), zero


def pack_awq(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> dict[str, torch.Tensor]:
    """(q [N, K] 0..15, scale [N, K / g], zero [N, K / g] integers 0..15) -> the checkpoint's qweight,
    qzeros, scales (fp16). The inverse of unpack_awq, for writing test checkpoints."""
    if q.shape[1] % group_size:
        raise ValueError(f"K={q.shape[1]} is not a multiple of group_size {group_size}")
    return {
        "qweight": pack_columns(q.t()),
        "qzeros": pack_columns(zero.round().t()),
        "scales": scale.t().to(torch.float16).contiguous(),
    }
