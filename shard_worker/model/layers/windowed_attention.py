"""TEMPORARY, until the attention backends (shard_worker/attention/) land on this branch: today's
PagedAttention with the layer's sliding window honoured on its per-sequence path (float64, which the
end-to-end tests run in). Removed at that merge; the families then build shard_worker.attention.Attention,
which has the same constructor and call shape."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shard_worker.model.attention import AttentionMetadata, PagedAttention, flex_supported


class Attention(PagedAttention):
    def __init__(self, num_heads, num_kv_heads, head_dim, scale, sliding_window: int | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.sliding_window = sliding_window

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata):
        if self.sliding_window and flex_supported(kv_cache.dtype, kv_cache.device):
            raise NotImplementedError("sliding windows need the attention backends (float64 until then)")
        return super().forward(q, k, v, kv_cache, md)

    def _attend_each_sequence(self, q, kv_cache, md: AttentionMetadata):
        _, _, block_size, kvh, d = kv_cache.shape
        out = torch.empty_like(q)
        for seq, (start, q_len, c_len) in enumerate(
            zip(md.token_starts, md.query_lens, md.context_lens, strict=True)
        ):
            blocks = md.block_table[seq, : -(-c_len // block_size)]
            keys = kv_cache[0].index_select(0, blocks).view(-1, kvh, d)[:c_len].transpose(0, 1)
            values = kv_cache[1].index_select(0, blocks).view(-1, kvh, d)[:c_len].transpose(0, 1)
            key_pos = torch.arange(c_len, device=q.device)
            query_pos = torch.arange(c_len - q_len, c_len, device=q.device)[:, None]
            mask = key_pos <= query_pos
            if self.sliding_window:
                mask &= key_pos > query_pos - self.sliding_window
            o = F.scaled_dot_product_attention(
                q[start : start + q_len].transpose(0, 1),
                keys,
                values,
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start : start + q_len] = o.transpose(0, 1)
        return out
