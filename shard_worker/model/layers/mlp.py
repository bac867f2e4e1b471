"""The gated MLP every family here uses: down(act(gate(x)) * up(x)), gate and up in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.attention import cpu_ops
from shard_worker.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from shard_worker.parallel import TensorParallel


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.json's activation names (transformers' ACT2FN keys) -> the function.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class GatedMLP(nn.Module):
    """Column-parallel gate/up (each rank its slice of the intermediate features), row-parallel down."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, tp: TensorParallel):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu and (h := cpu_ops.silu_mul(gate_up)) is not None:  # CPU, half types: one call
            return self.down_proj(h)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
