"""AWQ (GEMM) and GPTQ codecs (shard_worker/model/quant/awq.py, gptq.py).

The packers write the formats as documented; each checkpoint is read back two ways: by the codec's
vectorised unpacker, and by the plain loops below, written from the format descriptions (AutoAWQ's
WQLinear_GEMM order_map [0, 2, 4, 6, 1, 3, 5, 7]; AutoGPTQ's sequential packing along K and the stored
zero minus one), one int32 and one bit field at a time. Literal words pin the packing to the documents
rather than to the packer agreeing with itself.
"""

from __future__ import annotations

import pytest
import torch

from shard_worker.model.quant.awq import pack_awq, unpack_awq
from shard_worker.model.quant.gptq import act_order_permutation, pack_gptq, unpack_gptq
from shard_worker.model.quant.kernels import PackedInt4

AWQ_DOC_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column each successive 4-bit field of a word holds


def field(word: int, i: int) -> int:
    return (int(word) & 0xFFFFFFFF) >> (4 * i) & 0xF


def reference_awq_weight(qweight, qzeros, scales, group):
    """Dequantized W [N, K] from AWQ GEMM tensors, one bit field at a time."""
    k, words = qweight.shape
    n = words * 8
    w = torch.zeros(n, k, dtype=torch.float64)
    for row in range(k):
        for word in range(words):
            for i in range(8):
                col = word * 8 + AWQ_DOC_ORDER[i]
                q = field(qweight[row, word], i)
                z = field(qzeros[row // group, word], i)
                w[col, row] = (q - z) * float(scales[row // group, col])
    return w


def reference_gptq_weight(qweight, qzeros, scales, g_idx, offset=1):
    """Dequantized W [N, K] from GPTQ tensors, one bit field at a time."""
    words, n = qweight.shape
    k = words * 8
    w = torch.zeros(n, k, dtype=torch.float64)
    for row in range(k):
        g = int(g_idx[row])
        for col in range(n):
            q = field(qweight[row // 8, col], row % 8)
            z = field(qzeros[g, col // 8], col % 8) + offset
            w[col, row] = (q - z) * float(scales[g, col])
    return w


def random_weights(n, k, group, seed=0, zero_low=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half().float()  # fp16 on disk
    zero = torch.randint(zero_low, 16, (n, k // group), generator=g).float()
    return q, scale, zero


def dequantized(q, scale, zero, group):
    return (q.double() - zero.double().repeat_interleave(group, 1)) * scale.double().repeat_interleave(
        group, 1
    )


def test_awq_word_layout_matches_the_documented_order():
    # Columns 0..7 of one row hold the values 0..7: field i holds column order[i], value order[i].
    q = torch.arange(8, dtype=torch.uint8).repeat(8, 1).t().contiguous()  # [N=8, K=8], q[n, k] = n
    packed = pack_awq(q, torch.ones(8, 1), torch.zeros(8, 1), group_size=8)
    assert packed["qweight"].shape == (8, 1)
    assert int(packed["qweight"][0, 0]) & 0xFFFFFFFF == 0x75316420


def test_gptq_word_layout_and_zero_offset():
    q = torch.arange(8, dtype=torch.uint8).repeat(8, 1)  # [N=8, K=8], q[n, k] = k
    zero = torch.full((8, 1), 8.0)
    packed = pack_gptq(q, torch.ones(8, 1), zero, group_size=8)
    assert int(packed["qweight"][0, 0]) & 0xFFFFFFFF == 0x76543210  # K packed sequentially
    assert int(packed["qzeros"][0, 0]) & 0xFFFFFFFF == 0x77777777  # symmetric v1: zero 8 stored as 7


@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (24, 96, 32)])
def test_awq_unpacks_to_the_independent_reference(n, k, group):
    q, scale, zero = random_weights(n, k, group)
    tensors = pack_awq(q, scale, zero, group)
    assert tensors["qweight"].shape == (k, n // 8) and tensors["qzeros"].shape == (k // group, n // 8)
    assert tensors["scales"].shape == (k // group, n) and tensors["scales"].dtype == torch.float16
    uq, us, uz = unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
    assert torch.equal(uq, q) and torch.equal(us, scale) and torch.equal(uz, zero)
    reference = reference_awq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
    torch.testing.assert_close(dequantized(uq, us, uz, group), reference, rtol=0, atol=0)
    packed = PackedInt4.pack(uq, us, uz, group)
    torch.testing.assert_close(packed.dequantize(torch.float64), reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fmt,zero_low", [("gptq", 1), ("gptq_v2", 0)])
def test_gptq_unpacks_to_the_independent_reference(fmt, zero_low):
    n, k, group = 16, 64, 16
    q, scale, zero = random_weights(n, k, group, seed=1, zero_low=zero_low)
    tensors = pack_gptq(q, scale, zero, group, checkpoint_format=fmt)
    assert tensors["qweight"].shape == (k // 8, n) and tensors["qzeros"].shape == (k // group, n // 8)
    w = unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group, tensors["g_idx"], fmt)
    assert w.perm is None
    assert torch.equal(w.q, q) and torch.equal(w.scale, scale) and torch.equal(w.zero, zero)
    offset = 1 if fmt == "gptq" else 0
    reference = reference_gptq_weight(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], offset
    )
    torch.testing.assert_close(dequantized(w.q, w.scale, w.zero, group), reference, rtol=0, atol=0)


def test_gptq_desc_act_is_served_by_one_permutation_of_k():
    n, k, group = 16, 64, 16
    g = torch.Generator().manual_seed(2)
    q, scale, zero = random_weights(n, k, group, seed=2, zero_low=1)
    # act-order: GPTQ quantized the features in a permuted order, so feature k's group is arbitrary.
    order = torch.randperm(k, generator=g)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    tensors = pack_gptq(q, scale, zero, group, g_idx=g_idx)
    reference = reference_gptq_weight(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"]
    )
    w = unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group, tensors["g_idx"])
    assert w.perm is not None
    # The permuted weight applied to the permuted input is the layer's product.
    x = torch.randn(3, k, dtype=torch.float64)
    permuted = dequantized(w.q, w.scale, w.zero, group)
    torch.testing.assert_close(x[:, w.perm] @ permuted.t(), x @ reference.t())


def test_gptq_refuses_groups_of_unequal_size():
    g_idx = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="exactly 4 input features"):
        act_order_permutation(g_idx, 4)


def test_gptq_act_order_row_parallel_rank_reads_its_slice_with_all_groups():
    # A row-parallel rank holds K/2 features of an act-order layer: its g_idx names groups anywhere,
    # served when each group present has exactly group_size of this rank's features.
    n, k, g = 16, 64, 16
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // g, generator=gen) + 0.01).half().float()  # fp16 on disk
    zero = torch.randint(1, 16, (n, k // g), generator=gen).float()
    g_idx = torch.tensor([0, 2] * 16 + [1, 3] * 16)  # rank 0 holds groups 0 and 2, rank 1 groups 1 and 3
    t = pack_gptq(q, scale, zero, g, g_idx)
    full = (q.double() - zero[:, g_idx].double()) * scale[:, g_idx].double()
    x = torch.randn(2, k, dtype=torch.float64)
    total = 0
    for rank in range(2):
        cols = slice(rank * k // 2, (rank + 1) * k // 2)
        w = unpack_gptq(t["qweight"][rank * 4 : rank * 4 + 4], t["qzeros"], t["scales"], g, t["g_idx"][cols])
        local = (w.q.double() - w.zero.repeat_interleave(g, 1)) * w.scale.repeat_interleave(g, 1)
        xs = x[:, cols] if w.perm is None else x[:, cols][:, w.perm]
        total = total + xs @ local.t()
    torch.testing.assert_close(total, x @ full.t())
