"""The mixture-of-experts layer: routing as transformers routes, the batched expert computation (both
paths) against a naive loop over tokens, and experts sharded by hand over 2 and 4 ranks summing to the
whole (as tests/unit/test_parallel_layers.py does for the linears)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shard_worker.model.layers import moe
from shard_worker.model.layers.moe import FusedMoE, SparseMoE, route
from shard_worker.parallel import TensorParallel

E, H, N, K, T = 8, 32, 24, 2, 37


def rand(*shape: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def experts_weights(dtype):
    return rand(E, 2 * N, H, seed=1, dtype=dtype) * 0.2, rand(E, H, N, seed=2, dtype=dtype) * 0.2


def load(layer: FusedMoE, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    for e in range(E):
        layer.gate_up_proj.weight_loader(layer.gate_up_proj, gate_up[e, :N], (e, 0))
        layer.gate_up_proj.weight_loader(layer.gate_up_proj, gate_up[e, N:], (e, 1))
        layer.down_proj.weight_loader(layer.down_proj, down[e], (e, None))


def naive(x, gate_up, down, ids, weights):
    """One token and one of its experts at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g, u = F.linear(x[t], gate_up[ids[t, j]]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(g) * u, down[ids[t, j]])
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["loop", "grouped"])
def test_experts_equal_a_loop_over_tokens(dtype):
    torch.set_default_dtype(dtype)
    try:
        layer = FusedMoE(E, H, N, "silu", TensorParallel())
    finally:
        torch.set_default_dtype(torch.float32)
    gate_up, down = experts_weights(dtype)
    load(layer, gate_up, down)
    x = rand(T, H, seed=3, dtype=dtype)
    # Expert 5 chosen by no token: it must cost and change nothing.
    ids = torch.randint(0, E - 1, (T, K), generator=torch.Generator().manual_seed(4))
    ids[ids == 5] = 7
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(5), dtype=dtype)
    assert moe.grouped_mm_supported(x, H, N) == (dtype == torch.float32)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(layer(x, ids, weights), naive(x, gate_up, down, ids, weights), **tol)


def test_routing_is_transformers_routing():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x = rand(T, H, seed=6)
    w = rand(E, H, seed=7)
    mixtral = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K))
    qwen = Qwen3MoeTopKRouter(
        Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
    )
    for router in (mixtral, qwen):
        router.to(torch.float64).weight.data.copy_(w)
    _, want_w, want_ids = mixtral(x)
    got_w, got_ids = route(F.linear(x, w), K, renormalize=True, weights_dtype=None)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert got_w.dtype == torch.float32  # Mixtral keeps the weights in float32
    _, want_w, want_ids = qwen(x)
    got_w, got_ids = route(F.linear(x, w), K, renormalize=False, weights_dtype=torch.float64)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("ws", [2, 4])
def test_sharded_experts_sum_to_the_whole(ws):
    gate_up, down, router = *experts_weights(torch.float32), rand(E, H, seed=8, dtype=torch.float32)
    x = rand(T, H, seed=9, dtype=torch.float32)

    def make(tp):
        layer = SparseMoE(H, N, E, K, "silu", tp, renormalize=True, weights_in_model_dtype=False)
        layer.gate.weight.data.copy_(router)
        load(layer.experts, gate_up, down)
        return layer

    whole = make(TensorParallel())(x)
    partials = [make(TensorParallel(rank=r, world_size=ws)).forward_partial(x) for r in range(ws)]
    torch.testing.assert_close(sum(partials), whole, rtol=1e-5, atol=1e-5)
