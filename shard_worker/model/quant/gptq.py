"""GPTQ's checkpoint layout (AutoGPTQ / GPTQModel / optimum, 4-bit), to and from the (q, scale, zero)
form PackedInt4 takes. Pure functions on tensors.

On disk, for a linear layer y = x W^T with W [N, K], group g:
    qweight  int32 [K / 8, N]      eight 4-bit values per int32 along K, in order: bits 4j..4j+3 of
                                   qweight[i, n] hold q[8i + j, n]
    qzeros   int32 [G, N / 8]      the groups' zero points packed along N in the same sequential order,
                                   stored minus one in the common "gptq" (v1) format (AutoGPTQ's
                                   historical off-by-one; symmetric checkpoints store 7 for zero 8);
                                   "gptq_v2" (GPTQModel) stores them as they are
    scales   fp16  [G, N]
    g_idx    int32 [K]             the group of each input feature: k // g, or with desc_act (act-order)
                                   a grouping in the order GPTQ quantized the features
    w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]

desc_act is served by permuting K once at load: features sorted by group (stable), so each group is
contiguous again, which is exact when every group holds exactly g features (what GPTQ writes); the
layer then gathers its input with the same permutation per product (`perm`, an index along K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 4
PACK = 32 // BITS
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to a stored zero


@dataclass
class GPTQWeight:
    q: torch.Tensor  # uint8 [N, K] (K in `perm` order when perm is set)
    scale: torch.Tensor  # float32 [N, K / g]
    zero: torch.Tensor  # float32 [N, K / g]
    perm: torch.Tensor | None  # int64 [K]: the layer multiplies x[..., perm]; None: identity


def _shifts(device) -> torch.Tensor:
    return torch.arange(0, 32, BITS, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R / 8, C] -> uint8 [R, C] (eight values per int32 along the rows, sequential)."""
    nibbles = (packed.to(torch.int32)[:, None, :] >> _shifts(packed.device)[None, :, None]) & 15
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] -> uint8 [R, C] (eight values per int32 along the columns, sequential)."""
    nibbles = (packed.to(torch.int32)[..., None] >> _shifts(packed.device)) & 15
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def _words(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Packs eight 4-bit values per int32 along dim (0 or 1) of a 2-D tensor, sequential order."""
    v = values.to(torch.int64)
    if v.shape[dim] % PACK:
        raise ValueError(f"GPTQ packs eight values per int32; {v.shape[dim]} along dim {dim}")
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64, device=v.device)
    if dim == 0:
        words = (v.reshape(-1, PACK, v.shape[1]) << shifts[None, :, None]).sum(dim=1)
    else:
        words = (v.reshape(v.shape[0], -1, PACK) << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """None when g_idx never decreases (groups already contiguous); else the stable sort of K by group,
    which makes every group contiguous. Raises ValueError unless every group present holds exactly
    group_size features (a row-parallel rank's slice of an act-order layer may name any groups)."""
    g_idx = g_idx.to(torch.int64)
    counts = torch.bincount(g_idx)
    present = counts[counts > 0]
    if g_idx.numel() % group_size or bool((present != group_size).any()):
        raise ValueError(
            f"GPTQ g_idx does not put exactly {group_size} input features in each group: not servable"
        )
    if bool((g_idx[1:] >= g_idx[:-1]).all()):
        return None
    return torch.sort(g_idx, stable=True).indices


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    checkpoint_format: str = "gptq",
) -> GPTQWeight:
    """GPTQ tensors (one rank's slices of them) -> GPTQWeight for PackedInt4 (+ the input permutation).
    scales/qzeros rows are indexed by g_idx's values (all groups, for a row-parallel rank with desc_act;
    without g_idx, this slice's own groups in order)."""
    if checkpoint_format not in ZERO_OFFSET:
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported")
    q = unpack_rows(qweight).t()  # [N, K]
    n, k = q.shape
    zero = unpack_cols(qzeros)[:, :n].float() + ZERO_OFFSET[checkpoint_format]  # [G, N]
    scale = scales.float()
    if scale.shape[1] != n or zero.shape[0] != scale.shape[0]:
        raise ValueError(
            f"GPTQ shapes: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    if g_idx is None:
        g_idx = torch.arange(k, device=q.device) // group_size
    g_idx = g_idx.to(torch.int64)
    perm = act_order_permutation(g_idx, group_size)
    if perm is not None:
        q = q[:, perm]
        g_idx = g_idx[perm]
    # One (scale, zero) per contiguous group of the (permuted) K: the group of its first feature.
    first = g_idx[::group_size]
    return GPTQWeight(q.contiguous(), scale[first].t().contiguous(), zero[first].t().contiguous(), perm)


def pack_gptq(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    checkpoint_format: str = "gptq",
) -> dict[str, torch.Tensor]:
    """(q [N, K] 0..15 in the features' own order, scale/zero [N, G] per group, g_idx [K] the group of
    each feature, default k // g) -> the checkpoint's qweight, qzeros, scales (fp16), g_idx. The
    inverse of unpack_gptq, for writing test checkpoints."""
    n, k = q.shape
    if g_idx is None:
        g_idx = torch.arange(k) // group_size
    stored = zero.round().to(torch.int64).t() - ZERO_OFFSET[checkpoint_format]  # [G, N]
    if bool((stored < 0).any()):
        raise ValueError("GPTQ v1 cannot store a zero point of 0 (it is stored minus one)")
    return {
        "qweight": _words(q.t(), dim=0),
        "qzeros": _words(stored, dim=1),
        "scales": scale.t().to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
