"""A merged parameter filled from one fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) holds, on
every rank, exactly what it holds when filled from the separate tensors (Llama's q/k/v, gate/up)."""

from __future__ import annotations

import pytest
import torch

from shard_worker.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from shard_worker.parallel import TensorParallel


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("ws", "num_kv_heads"), [(1, 2), (2, 2), (4, 2), (2, 1)])
def test_fused_qkv_equals_separate(ws, num_kv_heads):
    hidden, head_dim, heads = 16, 4, 4
    parts = [rand(n * head_dim, hidden, seed=i) for i, n in enumerate((heads, num_kv_heads, num_kv_heads))]
    for rank in range(ws):
        tp = TensorParallel(rank=rank, world_size=ws)
        separate, fused = (QKVParallelLinear(hidden, head_dim, heads, num_kv_heads, tp) for _ in range(2))
        for i, w in enumerate(parts):
            separate.weight.weight_loader(separate.weight, w, i)
        fused.weight.weight_loader(fused.weight, torch.cat(parts), None)
        assert torch.equal(fused.weight, separate.weight)


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_fused_gate_up_equals_separate(ws):
    gate, up = rand(8, 6, seed=1), rand(8, 6, seed=2)
    for rank in range(ws):
        tp = TensorParallel(rank=rank, world_size=ws)
        separate, fused = (MergedColumnParallelLinear(6, [8, 8], tp) for _ in range(2))
        separate.weight.weight_loader(separate.weight, gate, 0)
        separate.weight.weight_loader(separate.weight, up, 1)
        fused.weight.weight_loader(fused.weight, torch.cat([gate, up]), None)
        assert torch.equal(fused.weight, separate.weight)
