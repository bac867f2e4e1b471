"""RMS norms, computed in float32 whatever the model dtype, exactly as transformers computes them.

Half types need float32's range; and matching the reference's arithmetic keeps our outputs comparable
with it closely (in float64 too: transformers downcasts to float32 there as well, so we do the same).

On CPU in a half type the norm (and the residual add before it, `add_forward`) is one call into the
attention kernel's library (attention/cpu_ops.py), rounding where these torch ops round: eight torch ops of
a few microseconds each became one call. float32 and float64 keep the torch ops, whose sum of squares the
call would add up in another order.
"""

from __future__ import annotations

import torch
from torch import nn

from shard_worker.attention import cpu_ops


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Llama's: weight * normalize(x), the product taken in the model dtype."""

    gemma = False

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.fused_norm_dtype(x) and (done := cpu_ops.rms_norm(x, self.weight, self.eps, self.gemma)):
            return done[1]
        return self.reference(x)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm)."""
        if cpu_ops.fused_norm_dtype(residual):
            done = cpu_ops.rms_norm(residual, self.weight, self.eps, self.gemma, delta=delta)
            if done is not None:
                return done
        h = residual + delta
        return h, self(h)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' arithmetic, op by op."""
        return self.weight * _normalize(x, self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's: normalize(x) * (1 + weight), all of it in float32 (checkpoints store weight - 1, so a
    freshly initialised norm is zeros)."""

    gemma = True

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
