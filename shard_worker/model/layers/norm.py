"""RMS norms, computed in float32 whatever the model dtype, exactly as transformers computes them.

Half types need float32's range; and matching the reference's arithmetic keeps our outputs comparable
with it closely (in float64 too: transformers downcasts to float32 there as well, so we do the same).
"""

from __future__ import annotations

import torch
from torch import nn


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Llama's: weight * normalize(x), the product taken in the model dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normalize(x, self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's: normalize(x) * (1 + weight), all of it in float32 (checkpoints store weight - 1, so a
    freshly initialised norm is zeros)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
