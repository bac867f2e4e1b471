"""The attention layer a model family builds: what this layer is (heads, scale, window), not how it runs."""

from __future__ import annotations

import torch
from torch import nn

from shard_worker.attention.backend import AttentionContext


class Attention(nn.Module):
    """Paged attention of one layer, with this rank's heads. The step's backend does the work."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.queries_per_kv = num_heads // num_kv_heads
        # An fp8 KV cache holds k / k_scale and v / v_scale: the checkpoint's k_scale and v_scale tensors
        # when it has them (model/loader.py), else 1.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # gpt-oss's attention sinks: per local head, a learned logit in the softmax's denominator (a key
        # every query sees whose value is zero). None: no sink. The family sets it (a parameter).
        self.sinks: torch.Tensor | None = None
        # Its layer group (common/kv_cache_spec.py): which of the step's block tables it reads, set when
        # the runner lays out the cache (0: the only one, or the full-attention layers').
        self.kv_group = 0
        # An image's placeholder tokens attend to each other both ways (Gemma 3; StepBatch.image_spans).
        # The family sets it; a backend that cannot is refused at start-up.
        self.image_bidirectional = False

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        ctx: AttentionContext,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        if ctx.groups:
            ctx = ctx.groups[self.kv_group]
        return ctx.backend.forward(self, q, k, v, kv_cache, ctx)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{window}"
