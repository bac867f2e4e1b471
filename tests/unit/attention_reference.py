"""The gather implementation that shard_worker/model/attention.py replaced, kept as the reference the
new attention is compared with (tests) and benchmarked against (bench/attention.py). Same interface as
the new one; reference_attention() swaps it into a ModelRunner.

Paged attention over a block KV cache, in plain torch (scaled_dot_product_attention).

A step's sequences fall into two groups, each attended in one batched call per layer:
- decode sequences (query_len 1), the dominant case: one query each, keys gathered from their blocks and
  masked by context length, so a batch of decodes costs one gather and one SDPA call with no padding of
  the queries;
- prefill sequences (query_len > 1, a whole prompt or a chunk of one after earlier chunks already in the
  cache): queries padded to the longest in the group, causal mask offset by the cached context.
Everything that depends only on the step's shape (gather indices, masks) is computed once per step in
AttentionMetadata; a layer only writes its new keys/values and runs the gathers and SDPA.

Query heads that share a KV head are folded into the query-length dimension ([G, kv_heads, rep*q, d]),
so keys and values are never repeated per query head and any SDPA backend can be used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together in one SDPA call, padded to max_query_len queries each."""

    num_seqs: int
    max_query_len: int
    # [G * max_query_len]: the flat token row each padded query slot reads (padding repeats the last
    # token); None when that is every token of the step in order.
    query_index: torch.Tensor | None
    # [G * max_query_len] indices of the real (unpadded) slots; None when there is no padding.
    valid_index: torch.Tensor | None
    # Flat token rows the real slots' outputs go to; None when that is every token of the step in order.
    out_rows: torch.Tensor | None
    # [G * max_blocks] KV block ids (padding: block 0, masked out).
    block_ids: torch.Tensor
    max_blocks: int
    # Broadcastable to [G, kv_heads, rep * max_query_len, max_blocks * block_size]; True = attend.
    mask: torch.Tensor


@dataclass(frozen=True)
class ReferenceMetadata:
    """The step's shape as attention needs it. Built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    num_tokens: int
    groups: tuple[AttentionGroup, ...]
    # Per group, the buffers keys and values are gathered into: allocated by the first layer, reused
    # by the others (fresh multi-MB allocations per layer cost page faults on every step).
    _buffers: dict = field(default_factory=dict, compare=False)

    def gather_buffers(
        self, grp: AttentionGroup, cache_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bufs = self._buffers.get(id(grp))
        if bufs is None:
            shape = (grp.block_ids.numel(), cache_rows.shape[1])
            bufs = (cache_rows.new_empty(shape), cache_rows.new_empty(shape))
            self._buffers[id(grp)] = bufs
        return bufs

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        queries_per_kv: int,
    ) -> ReferenceMetadata:
        """The new interface (a [num_seqs, max_blocks] block table), flattened to what this one took."""
        block_table_lens = [-(-c // block_size) for c in context_lens]
        rows = [block_table[s, :n] for s, n in enumerate(block_table_lens)]
        block_tables = torch.cat(rows).long() if rows else block_table.new_zeros(0).long()
        return cls._build(
            query_lens, context_lens, block_table_lens, block_tables, slot_mapping, block_size, queries_per_kv
        )

    @classmethod
    def _build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_table_lens: list[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        queries_per_kv: int,
    ) -> ReferenceMetadata:
        """query/context/block-table lengths are per sequence; block_tables (all sequences' tables
        concatenated) and slot_mapping are tensors already on the device."""
        num_seqs = len(query_lens)
        for name, values in (("context_lens", context_lens), ("block_table_lens", block_table_lens)):
            if len(values) != num_seqs:
                raise ValueError(f"{name} has {len(values)} entries for {num_seqs} sequences")
        num_tokens = sum(query_lens)
        if slot_mapping.numel() != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries for {num_tokens} tokens")
        token_starts = [0, *accumulate(query_lens)][:-1]
        table_starts = [0, *accumulate(block_table_lens)][:-1]
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        prefill = [i for i, q in enumerate(query_lens) if q != 1]
        groups = []
        for members in (decode, prefill):
            if members:
                groups.append(
                    _build_group(
                        members,
                        [query_lens[i] for i in members],
                        [context_lens[i] for i in members],
                        [token_starts[i] for i in members],
                        [table_starts[i] for i in members],
                        [block_table_lens[i] for i in members],
                        num_tokens,
                        block_tables,
                        block_size,
                        queries_per_kv,
                    )
                )
        return cls(slot_mapping=slot_mapping, num_tokens=num_tokens, groups=tuple(groups))


def _build_group(
    members: list[int],
    q_lens: list[int],
    c_lens: list[int],
    token_starts: list[int],
    table_starts: list[int],
    table_lens: list[int],
    num_tokens: int,
    block_tables: torch.Tensor,
    block_size: int,
    queries_per_kv: int,
) -> AttentionGroup:
    device = block_tables.device
    num_blocks = []
    for seq, q, c, n in zip(members, q_lens, c_lens, table_lens, strict=True):
        if not 1 <= q <= c:
            raise ValueError(f"sequence {seq}: query_len {q} must be in [1, context_len {c}]")
        needed = -(-c // block_size)
        if needed > n:
            raise ValueError(f"sequence {seq}: context_len {c} needs {needed} blocks, block table has {n}")
        num_blocks.append(needed)
    g, max_q, max_blocks = len(members), max(q_lens), max(num_blocks)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    q_len, c_len = tensor(q_lens), tensor(c_lens)
    j = torch.arange(max_q, device=device)
    last_query = torch.minimum(j[None, :], q_len[:, None] - 1)  # [G, Q]: padding repeats the last query
    whole_step_in_order = g * max_q == num_tokens and token_starts == list(range(0, num_tokens, max_q))
    query_index = None if whole_step_in_order else (tensor(token_starts)[:, None] + last_query).reshape(-1)
    if max_q == 1 or min(q_lens) == max_q:
        valid_index, out_rows = None, query_index
    else:
        valid_index = (j[None, :] < q_len[:, None]).reshape(-1).nonzero().squeeze(1)
        out_rows = query_index.index_select(0, valid_index) if query_index is not None else valid_index

    b = torch.arange(max_blocks, device=device)
    in_table = b[None, :] < tensor(num_blocks)[:, None]
    block_ids = block_tables.index_select(0, (tensor(table_starts)[:, None] + b[None, :])[in_table])
    padded_ids = torch.zeros(g, max_blocks, dtype=block_ids.dtype, device=device)
    padded_ids[in_table] = block_ids

    # Query j of a sequence sits at position c - q + j and may see keys up to and including it.
    key_pos = torch.arange(max_blocks * block_size, device=device)
    limit = c_len[:, None] - q_len[:, None] + last_query  # [G, Q]
    mask = key_pos[None, None, :] <= limit[:, :, None]  # [G, Q, K]
    mask = mask.unsqueeze(1)  # [G, 1, Q, K]: the same for every KV head
    if max_q > 1:
        # Folded query rows are ordered (query head within the KV group, query position).
        mask = mask.repeat(1, 1, queries_per_kv, 1)
    return AttentionGroup(
        num_seqs=g,
        max_query_len=max_q,
        query_index=query_index,
        valid_index=valid_index,
        out_rows=out_rows,
        block_ids=padded_ids.reshape(-1),
        max_blocks=max_blocks,
        mask=mask,
    )


class ReferencePagedAttention(torch.nn.Module):
    """Writes a layer's new keys/values into its cache and attends over each sequence's blocks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.rep = num_heads // num_kv_heads

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, d]
        k: torch.Tensor,  # [T, kv_heads, d]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, blocks, block_size, kv_heads, d]
        md: ReferenceMetadata,
    ) -> torch.Tensor:  # [T, heads, d]
        _, num_blocks, block_size, kvh, d = kv_cache.shape
        # 2-D views: index_select/index_copy_ over whole rows run as row copies, about 3x faster than
        # over the same data viewed in 4-D (the gather of keys and values was half of a decode step).
        key_cache = kv_cache[0].view(num_blocks, block_size * kvh * d)
        value_cache = kv_cache[1].view(num_blocks, block_size * kvh * d)
        key_cache.view(-1, kvh * d).index_copy_(0, md.slot_mapping, k.reshape(-1, kvh * d))
        value_cache.view(-1, kvh * d).index_copy_(0, md.slot_mapping, v.reshape(-1, kvh * d))

        out = None
        for grp in md.groups:
            g, nq = grp.num_seqs, grp.max_query_len
            qg = q if grp.query_index is None else q.index_select(0, grp.query_index)
            # [G*Q, H, d] -> [G, kvh, rep*Q, d], rows ordered (rep, Q) to match the mask.
            qg = qg.view(g, nq, kvh, self.rep, d).permute(0, 2, 3, 1, 4).reshape(g, kvh, self.rep * nq, d)
            kbuf, vbuf = md.gather_buffers(grp, key_cache)
            keys = (
                torch.index_select(key_cache, 0, grp.block_ids, out=kbuf).view(g, -1, kvh, d).transpose(1, 2)
            )
            values = (
                torch.index_select(value_cache, 0, grp.block_ids, out=vbuf)
                .view(g, -1, kvh, d)
                .transpose(1, 2)
            )
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=grp.mask, scale=self.scale)
            o = o.view(g, kvh, self.rep, nq, d).permute(0, 3, 1, 2, 4).reshape(g * nq, self.num_heads, d)
            if grp.valid_index is not None:
                o = o.index_select(0, grp.valid_index)
            if grp.out_rows is None:
                return o  # this group is the whole step, in order
            if out is None:
                out = q.new_empty(md.num_tokens, self.num_heads, d)
            out.index_copy_(0, grp.out_rows, o)
        return out


@contextlib.contextmanager
def reference_attention(runner) -> Iterator[None]:
    """Runs a ModelRunner's steps with this implementation instead of the production one."""
    import shard_worker.model_runner as model_runner

    layers = [layer.self_attn for layer in runner.model.model.layers]
    saved = [attn.attn for attn in layers]
    saved_metadata = model_runner.AttentionMetadata
    for attn in layers:
        old = attn.attn
        attn.attn = ReferencePagedAttention(old.num_heads, old.num_kv_heads, old.head_dim, old.scale)
    model_runner.AttentionMetadata = ReferenceMetadata
    try:
        yield
    finally:
        model_runner.AttentionMetadata = saved_metadata
        for attn, old in zip(layers, saved, strict=True):
            attn.attn = old
