"""The fused CPU ops of a decode step (shard_worker/attention/cpu_ops.py) against the torch ops they
replace: the RMS norms (Llama's and Gemma's, with and without the residual add) within one rounding of the
element type where the sum of squares is added up in another order, rotary bit for bit, and a layer's KV
write with its attention equal to the torch write followed by the kernel's per-call path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shard_worker.attention import Attention, StepBatch, cpu_ops, select_backend
from shard_worker.attention.backend import write_kv
from shard_worker.model.layers.norm import GemmaRMSNorm, RMSNorm
from shard_worker.model.layers.rotary import RotaryEmbedding, RotarySpec, apply_rotary

torch.set_flush_denormal(True)
CPU = torch.device("cpu")


def _spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance from each element to the next representable one of its dtype, in float64."""
    mant = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[x.dtype]
    e = torch.frexp(x.double().abs().clamp_min(torch.finfo(x.dtype).tiny))[1]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - mant)


def _norms(cls, hidden: int, dtype, gen):
    norm = cls(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + (0 if cls is GemmaRMSNorm else 1))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 7), (5, 1000), (150, 576)])
def test_rms_norm_matches_the_torch_ops(dtype, cls, rows, hidden):
    """Norm of x + delta: the sum bit for bit; in half types the norm within one step of the element
    type, and equal in almost every element (150 rows of 576 spread over the threads)."""
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = _norms(cls, hidden, dtype, gen)
    wide = (torch.randn(rows, hidden + 3, generator=gen) * 3).to(dtype)
    x = wide[:, 1 : hidden + 1]  # rows with a stride of their own
    delta = torch.randn(rows, hidden, generator=gen).to(dtype)
    assert cpu_ops.fused_norm_dtype(x) == (dtype != torch.float32)
    total, got = cpu_ops.rms_norm(x, norm.weight, norm.eps, norm.gemma, delta=delta)
    assert torch.equal(total, x + delta)
    want = norm.reference(x + delta)
    diff = (got.double() - want.double()).abs()
    if dtype == torch.float32:  # not used for float32 models: close, not equal
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert bool((diff <= _spacing(want)).all())
        assert float((diff > 0).double().mean()) < 0.01
    alone = cpu_ops.rms_norm(x, norm.weight, norm.eps, norm.gemma)
    assert alone[0] is None
    # The module takes the call for half types, and keeps the torch ops for float32.
    assert torch.equal(norm(x), norm.reference(x) if dtype == torch.float32 else alone[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_module_add_forward_equals_add_then_norm(dtype):
    gen = torch.Generator().manual_seed(1)
    norm = _norms(RMSNorm, 64, dtype, gen)
    h, a = (torch.randn(4, 64, generator=gen).to(dtype) for _ in range(2))
    total, out = norm.add_forward(h, a)
    assert torch.equal(total, h + a)
    assert torch.equal(out, norm(h + a))


def test_float32_and_float64_norms_keep_the_torch_ops():
    """Their outputs stay exactly what the torch ops give (the fused sum of squares would differ)."""
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.float64):
        norm = _norms(RMSNorm, 96, dtype, gen)
        x, a = (torch.randn(3, 96, generator=gen, dtype=dtype) for _ in range(2))
        assert torch.equal(norm(x), norm.reference(x))
        total, out = norm.add_forward(x, a)
        assert torch.equal(out, norm.reference(x + a))


def test_rms_norm_refuses_what_it_cannot_take():
    w = torch.ones(8, dtype=torch.bfloat16)
    x = torch.randn(4, 8).to(torch.bfloat16)
    assert not cpu_ops.fused_norm_dtype(x.t())  # columns, not rows
    assert not cpu_ops.fused_norm_dtype(x.view(2, 2, 8))
    assert cpu_ops.rms_norm(x, w.float(), 1e-6) is None  # weight in another dtype
    assert cpu_ops.rms_norm(x, torch.ones(9, dtype=torch.bfloat16), 1e-6) is None
    assert cpu_ops.rms_norm(x, w, 1e-6, delta=torch.randn(4, 8)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (7, 4, 2, 6), (300, 8, 8, 64)])
def test_rotary_in_place_is_the_torch_ops_bit_for_bit(dtype, tokens, heads, kv_heads, head_dim):
    """q and k as the attention block has them (views of one q/k/v projection's rows), cos and sin
    from the model's rotary module; 300 tokens spread over the threads."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    spec = RotarySpec(tuple((1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)).tolist()), 1.0)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(spec)(positions, dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert cpu_ops.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rotary_refuses_float64_and_mixed_dtypes():
    q, k = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 2, 8, dtype=torch.float64)
    cos = sin = torch.ones(2, 1, 8, dtype=torch.float64)
    assert not cpu_ops.rotary_(q, k, cos, sin)
    assert not cpu_ops.rotary_(q.float(), k.float(), cos, sin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 5), (64, 1536)])
def test_silu_mul_matches_the_torch_ops(dtype, rows, inter):
    """F.silu(gate) * up, but for silu rounded one step of the element type the other way in a few
    elements (its exp is another polynomial than torch's); gates from -100 to 100, rows with a stride
    of their own."""
    gen = torch.Generator().manual_seed(rows + inter)
    wide = torch.randn(rows, 2 * inter + 4, generator=gen) * 4
    wide[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    x = wide.to(dtype)[:, 2 : 2 + 2 * inter]
    got = cpu_ops.silu_mul(x)
    if dtype == torch.float32:
        assert got is None  # float32 keeps torch's silu
        return
    gate, up = x.chunk(2, dim=-1)
    silu = torch.nn.functional.silu(gate)
    want = silu * up
    # One step of silu's rounding (times up), then one of the product's.
    bound = _spacing(silu) * up.double().abs() + _spacing(want)
    diff = (got.double() - want.double()).abs()
    assert bool((diff <= bound).all())
    assert float((diff > 0).double().mean()) < 0.01


def _step(dtype, kv_heads=2, heads=4, d=16):
    """Two decodes and a 20-token prompt (SDPA's part) over scrambled blocks; q/k/v as views of one
    projection's rows."""
    q_lens, c_lens = np.array([1, 1, 20]), np.array([40, 3, 20])
    table = np.array([[5, 2, 9], [7, 0, 0], [1, 3, 0]])
    batch = StepBatch.build(np.zeros(22, dtype=np.int64), q_lens, c_lens, table, 16, CPU)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(22, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    cache = torch.randn(2, 10, 16, kv_heads, d, generator=gen).to(dtype)
    layer = Attention(heads, kv_heads, d, d**-0.5)
    return batch, layer, q.view(22, heads, d), k.view(22, kv_heads, d), v.view(22, kv_heads, d), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_call_equals_the_write_then_the_per_call_kernel(dtype):
    batch, layer, q, k, v, cache = _step(dtype)
    backend = select_backend("cpu", CPU, dtype)
    ctx = backend.context(batch)
    assert ctx.metadata.plan is not None
    fused = cache.clone()
    got = backend.forward(layer, q, k, v, fused, ctx)
    unfused = cache.clone()
    write_kv(unfused, k, v, batch.slot_mapping)
    want = backend.attend(layer, q, unfused, ctx)
    assert torch.equal(fused, unfused)
    assert torch.equal(got, want)


def test_layer_call_refuses_a_slot_outside_the_cache():
    batch, layer, q, k, v, cache = _step(torch.float32)
    backend = select_backend("cpu", CPU, torch.float32)
    ctx = backend.context(batch)
    small = cache[:, :4].contiguous()  # blocks 5, 7, 9 are past its end
    before = small.clone()
    with pytest.raises(ValueError, match="a KV slot of this step is outside the KV cache.s 4 blocks"):
        backend.forward(layer, q, k, v, small, ctx)
    assert torch.equal(small, before)  # nothing written


def test_argmax_is_torch_argmax():
    """The same index as torch.argmax: random rows of a vocabulary that is no multiple of the block, ties
    (the first), a NaN (the first NaN), all -inf, one column, rows with a stride of their own."""
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(9, 49157, generator=gen)
    wide[1, 70] = wide[1, 5000] = 50.0  # a tie across blocks
    wide[2, 3] = wide[2, 40000] = float("nan")
    wide[2, 10] = float("inf")
    wide[3] = float("-inf")
    wide[4, 49150] = 60.0  # the last, partial block
    wide[5, :100] = 0.0
    wide[5, 100:] = -1.0
    wide[5, 7] = -0.0  # -0.0 == 0.0: the first of them
    x = wide[:, 2:49155]
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
    one = torch.randn(3, 1, generator=gen)
    assert torch.equal(cpu_ops.argmax(one), one.argmax(dim=-1))
    assert cpu_ops.argmax(x.bfloat16()) is None  # float32 only: the sampler's logits
