"""MXFP4 (OCP microscaling FP4), the format gpt-oss's released checkpoints store their experts in, decoded
to floats at load.

A tensor `<name>_blocks` is uint8 [..., G, 16]: each byte two E2M1 values (low nibble first), each row of
16 bytes one block of 32 values sharing the scale `<name>_scales`, uint8 [..., G], an E8M0 exponent with
bias 127 (the block's values times 2 ** (scale - 127)). Decoded, the last two dimensions become G * 32
values: for gpt-oss's experts [experts, output rows, input], the nn.Linear layout of each expert.

What it costs: the file's 4.25 bits a weight become 16 (bfloat16) or 32 (float32). gpt-oss-20b's experts
(24 layers x 32 experts x 3 x 2880 x 2880 weights, 19.1 B) are 10.1 GB as MXFP4 and 38 GB in bfloat16;
gpt-oss-120b's (36 x 128 experts, 114.7 B) 61 GB and 229 GB. No kernel of ours reads MXFP4 in place yet.
"""

from __future__ import annotations

import torch

# E2M1: sign, two exponent bits, one mantissa bit; the nibble's value is its index here.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values a scale covers
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G * 32] values of dtype from blocks uint8 [..., G, 16] and scales uint8 [..., G]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}: "
            f"expected blocks [..., G, {BLOCK // 2}] and scales [..., G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    # Exact: every E2M1 value times a power of two is representable wherever the exponent fits.
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values.flatten(-2), exponents[..., None].to(dtype))
    return values.flatten(-2)
