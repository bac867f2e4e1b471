"""MXFP4 (OCP microscaling FP4), the format gpt-oss's released checkpoints store their experts in, decoded
to floats at load.

A tensor `<name>_blocks` is uint8 [..., G, 16]: each byte two E2M1 values (low nibble first), each row of
16 bytes one block of 32 values sharing the scale `<name>_scales`, uint8 [..., G], an E8M0 exponent with
bias 127 (the block's values times 2 ** (scale - 127)). Decoded, the last two dimensions become G * 32
values: for gpt-oss's experts [experts, output rows, input], the nn.Linear layout of each expert.

What it costs: the file's 4.25 bits a weight become 16 (bfloat16) or 32 (float32). gpt-oss-20b's experts
(24 layers x 32 experts x 3 x 2880 x 2880 weights, 19.1 B) are 10.1 GB as MXFP4 and 38 GB in bfloat16;
gpt-oss-120b's (36 x 128 experts, 114.7 B) 61 GB and 229 GB. No kernel of ours reads MXFP4 in place yet.

Mxfp4Config is the checkpoint format (quantization_config quant_method "mxfp4"): only the experts are
stored so (modules_to_not_convert: attention, router, embeddings, head), and Mxfp4ExpertMethod holds a
layer's blocks and scales (this rank's features) until the layer's last tensor is read, then decodes
them into the unquantized experts' weights and frees them. Every layer's blocks are allocated when the
model is built: on CPU their pages cost nothing until read (so the peak is about the decoded model plus
a layer's blocks), on CUDA they are held from the start (the peak is the decoded model plus all of the
MXFP4 experts, freed as each layer decodes).
"""

from __future__ import annotations

import torch
from torch import nn

from shard_worker.model.quant.base import QuantConfig, add_param
from shard_worker.model.quant.unquantized import UnquantizedExpertMethod

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


class Mxfp4Config(QuantConfig):
    """gpt-oss's released checkpoints: experts in MXFP4, decoded at load; every linear layer as stored."""

    name = "mxfp4"

    @classmethod
    def from_config(cls, quantization_config: dict, unquantized) -> Mxfp4Config:
        return cls(unquantized)

    def expert_method(self, layer: nn.Module, prefix: str):
        from shard_worker.model.layers.moe import GptOssExperts

        if not isinstance(layer, GptOssExperts):
            raise ValueError(f"mxfp4: only gpt-oss's experts are read in MXFP4, not {prefix}")
        return Mxfp4ExpertMethod()

    def describe(self) -> str:
        return "mxfp4 (experts decoded at load)"


class Mxfp4ExpertMethod(UnquantizedExpertMethod):
    """gate_up_proj_blocks [E, 2n, H / 32, 16] and _scales [E, 2n, H / 32] (this rank's n features of
    gate and of up, deinterleaved as FusedMoE holds them), down_proj_blocks [E, H, G, 16] and _scales
    [E, H, G] (the G blocks that cover this rank's n input features); decoded after loading into
    gate_up_proj [E, 2n, H] and down_proj [E, H, n] in the model's dtype, then served as the unquantized
    experts."""

    def create_weights(self, layer, num_experts, hidden_size, local_intermediate, params_dtype):
        if hidden_size % BLOCK:
            raise ValueError(
                f"mxfp4: hidden_size {hidden_size} is not a multiple of its {BLOCK}-value blocks"
            )
        self.dtype = params_dtype
        e, h, n = num_experts, hidden_size, local_intermediate
        # down's input features of this rank, in whole blocks: a rank's share need not fill whole blocks
        # (gpt-oss's 2880 features over 4 ranks are 720, 22.5 blocks), so it reads the blocks that cover
        # it and keeps its own columns after decoding.
        features = layer.feature_rows()
        self.down_groups = slice(features.start // BLOCK, -(-features.stop // BLOCK))
        self.down_offset = features.start - self.down_groups.start * BLOCK
        groups = self.down_groups.stop - self.down_groups.start
        shapes = {
            "gate_up_proj_blocks": ((e, 2 * n, h // BLOCK, BLOCK // 2), self._load_gate_up),
            "gate_up_proj_scales": ((e, 2 * n, h // BLOCK), self._load_gate_up),
            "down_proj_blocks": ((e, h, groups, BLOCK // 2), self._load_down),
            "down_proj_scales": ((e, h, groups), self._load_down),
        }
        for name, (shape, loader) in shapes.items():
            param = add_param(layer, name, shape, torch.uint8)
            param.weight_loader = lambda p, source, part=None, f=loader: f(layer, p, source)
            param.checkpoint_parts = (None,)

    def _load_gate_up(self, layer, param, source) -> None:
        from shard_worker.model.layers.linear import copy_checked
        from shard_worker.model.layers.moe import deinterleave

        rows = deinterleave(source[:, layer.feature_columns()], 1)  # output rows: g0 u0 g1 u1 ...
        copy_checked(param.data, rows, ..., "mxfp4 experts.gate_up_proj")

    def _load_down(self, layer, param, source) -> None:
        from shard_worker.model.layers.linear import copy_checked

        copy_checked(param.data, source[:, :, self.down_groups], ..., "mxfp4 experts.down_proj")

    def process_weights_after_loading(self, layer) -> None:
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = getattr(layer, f"{name}_blocks"), getattr(layer, f"{name}_scales")
            weight = dequantize_mxfp4(blocks.data, scales.data, self.dtype)
            if name == "down_proj":  # this rank's columns of the blocks it read
                weight = weight[..., self.down_offset : self.down_offset + layer.local_intermediate]
                weight = weight.contiguous()
            delattr(layer, f"{name}_blocks")
            delattr(layer, f"{name}_scales")
            layer.register_parameter(name, nn.Parameter(weight, requires_grad=False))
