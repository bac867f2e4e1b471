"""MXFP4 decoding (gpt-oss's expert weights) against transformers' own dequantization."""

import pytest
import torch

from shard_worker.model.quant.mxfp4 import dequantize_mxfp4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decodes_as_transformers_does(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    # [experts, output rows, groups, 16 bytes]: every nibble, and exponents around 1 (bias 127).
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 135, (3, 10, 4), dtype=torch.uint8, generator=g)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [experts, input, output rows]
    assert ours.shape == (3, 10, 128) and ours.dtype == dtype
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0)


def test_a_byte_is_two_values_low_nibble_first_times_its_block_scale():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x72  # low nibble 2 (1.0), high nibble 7 (6.0)
    blocks[0, 1] = 0x09  # -0.5, then 0
    out = dequantize_mxfp4(blocks, torch.tensor([129], dtype=torch.uint8), torch.float32)
    assert out.shape == (32,) and out[:4].tolist() == [4.0, 24.0, -2.0, 0.0]


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(
            torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), torch.float32
        )
