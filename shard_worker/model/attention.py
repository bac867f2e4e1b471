"""Paged attention that reads keys and values in place, through the block table.

The whole cache of a layer is one long key sequence ([num_blocks * block_size] slots) and the step's
tokens are the queries; torch's flex_attention (compiled: C++ on CPU, Triton on CUDA) runs over it with a
block-sparse mask built directly from the block tables. The mask's key block is our cache block, so every
query tile lists the physical blocks of its own sequence: the ones wholly before it ("full": no mask is
evaluated there) and the one holding its own position ("partial": a mask_mod decides per key). Nothing is
gathered, no query is padded to another sequence's length, and the mask metadata grows with the step's
tokens times blocks per sequence, never with queries x keys or with the number of sequences x context.

Query heads that share a KV head are folded into the query rows ([kv_heads, tokens * rep, d]), so one
tile loads each key block once for all of its heads. Tokens are tiled two ways, one flex call each:
- one token per tile (decodes and short queries): a tile's partial block is the token's own block, where
  it sees the slots up to its own slot;
- sixteen positions per tile, aligned to the sequence's blocks (prefill chunks of PREFILL_MIN_QUERY
  tokens or more): a tile's partial block is the block it covers, where row r sees offsets <= r. Up to
  block_size - 1 rows at either end of a chunk are padding, and tiles amortise each key block over 16
  queries: 1.2-2.7x faster than one-token tiles on prefill-heavy steps on CPU.
Each call's graph is compiled once with dynamic shapes (every size that varies per step is kept >= 2 by a
padding tile and a padding column, so no size is specialised to 1) and serves every later step.

Where the compiled kernel is not used (see flex_supported: float64, which the end-to-end tests compare
with transformers in; half types on CPU; CUDA until it is verified there) a plain-torch path attends one
sequence at a time, copying only that sequence's blocks: exact, workspace bounded by one sequence, slow
with many sequences.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# A sequence with at least this many query tokens in a step is tiled by blocks; shorter ones one token per
# tile. Measured on CPU, 32 sequences at context 2048, one-token vs block tiles: 8-token queries 148 vs
# 110 ms, 4-token 115 vs 124 ms, decodes 58 vs 124 ms.
PREFILL_MIN_QUERY = 8
# One-token tiles read their own slot from a buffer of this static size (a buffer sized by the step
# would give the compiled mask a dynamic size, which inductor's CPU template mis-generates: its
# `cur_qSplitSize` substitution is a plain text replace that can clobber another size's name). Short
# queries beyond it go to block tiles, which are exact too.
ONE_TOKEN_TILE_CAPACITY = 4096


def flex_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the compiled block-sparse kernel serves this cache dtype on this device.

    CPU float32 only, for now. CPU half types: the C++ template repacks the whole key and value tensors
    (here: the whole cache) on every call once it decides packing pays (AMX machines, 64+ query rows).
    CUDA: not verified on a device yet, and the Triton template needs query tiles that are multiples of
    its BLOCK_M (16 or more) and key tiles of its BLOCK_N, while our tiles are queries_per_kv rows and
    16 slots; it needs kernel_options (BLOCK_N=16) and another one-token tiling before it is enabled."""
    return device.type == "cpu" and dtype == torch.float32


@functools.cache
def _compiled_flex():
    # Created on first use, so processes that never take this path (float64) never import the compiler.
    return torch.compile(flex_attention, dynamic=True)


@dataclass(frozen=True)
class _Tiles:
    """The queries of one flex call: which step tokens, laid out in which rows, and their block mask."""

    tokens: torch.Tensor  # [n] step rows of the tokens this call computes
    rows: torch.Tensor  # [n] the token row each of them takes in this call's query layout
    num_rows: int  # token rows in the layout, padding included
    in_order: bool  # tokens and rows are both 0..n-1 and n is the whole step: no index ops needed
    block_mask: BlockMask


@dataclass(frozen=True)
class AttentionMetadata:
    """The step's shape as attention needs it. Built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    num_tokens: int
    block_size: int
    queries_per_kv: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, rows padded with block 0
    positions: torch.Tensor  # [T] each token's position in its sequence
    token_starts: tuple[int, ...]  # first step row of each sequence

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        queries_per_kv: int,
    ) -> AttentionMetadata:
        """query/context lengths are per sequence; block_table ([num_seqs, max_blocks], each row padded
        past its sequence's blocks) and slot_mapping ([T]) are tensors already on the device."""
        num_seqs = len(query_lens)
        if len(context_lens) != num_seqs:
            raise ValueError(f"context_lens has {len(context_lens)} entries for {num_seqs} sequences")
        if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
            raise ValueError(f"block_table has shape {tuple(block_table.shape)} for {num_seqs} sequences")
        num_tokens = sum(query_lens)
        if slot_mapping.numel() != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries for {num_tokens} tokens")
        for seq, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
            if not 1 <= q <= c:
                raise ValueError(f"sequence {seq}: query_len {q} must be in [1, context_len {c}]")
            if -(-c // block_size) > block_table.shape[1]:
                raise ValueError(
                    f"sequence {seq}: context_len {c} needs {-(-c // block_size)} blocks, "
                    f"block table has {block_table.shape[1]} columns"
                )
        device = slot_mapping.device
        token_starts = [0, *accumulate(query_lens)][:-1]
        # Per token: the position it computes, from its sequence's cached length and its offset in the step.
        lens = torch.tensor([query_lens, context_lens, token_starts], dtype=torch.long, device=device)
        seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), lens[0], output_size=num_tokens)
        first_pos = lens[1] - lens[0] - lens[2]  # position of a sequence's first query minus its start row
        positions = first_pos.index_select(0, seq) + torch.arange(num_tokens, device=device)
        return cls(
            slot_mapping=slot_mapping,
            num_tokens=num_tokens,
            block_size=block_size,
            queries_per_kv=queries_per_kv,
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            block_table=block_table.to(torch.int32),
            positions=positions,
            token_starts=tuple(token_starts),
        )

    def tiles(self, num_cache_blocks: int) -> tuple[_Tiles, ...]:
        """The flex calls for a cache of num_cache_blocks blocks; built by the first layer, reused."""
        cached = self._tiles
        if num_cache_blocks not in cached:
            cached[num_cache_blocks] = self._build_tiles(num_cache_blocks)
        return cached[num_cache_blocks]

    @cached_property
    def _tiles(self) -> dict[int, tuple[_Tiles, ...]]:
        return {}

    def _build_tiles(self, num_cache_blocks: int) -> tuple[_Tiles, ...]:
        one_token, by_block, taken = [], [], 0
        for seq, q in enumerate(self.query_lens):
            if q < PREFILL_MIN_QUERY and taken + q < ONE_TOKEN_TILE_CAPACITY:
                one_token.append(seq)
                taken += q
            else:
                by_block.append(seq)
        # One column and one tile of padding: the compiled graph then never sees a size of 1, which
        # would specialise it (and recompile when the size moves).
        table = F.pad(self.block_table, (0, 1))
        tiles = []
        if one_token:
            tiles.append(self._one_token_tiles(one_token, table, num_cache_blocks))
        if by_block:
            tiles.append(self._block_tiles(by_block, table, num_cache_blocks))
        return tuple(tiles)

    def _select_tokens(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Step rows of the given sequences' tokens (in order), and each one's index into seqs."""
        device = self.slot_mapping.device
        q_lens = [self.query_lens[s] for s in seqs]
        n = sum(q_lens)
        local_starts = [0, *accumulate(q_lens)][:-1]
        per_seq = torch.tensor(
            [[self.token_starts[s] - a for s, a in zip(seqs, local_starts, strict=True)], q_lens],
            dtype=torch.long,
            device=device,
        )
        which = torch.repeat_interleave(torch.arange(len(seqs), device=device), per_seq[1], output_size=n)
        tokens = per_seq[0].index_select(0, which) + torch.arange(n, device=device)
        return tokens, which, n

    def _one_token_tiles(self, seqs: list[int], table: torch.Tensor, num_cache_blocks: int) -> _Tiles:
        device, bs, rep = self.slot_mapping.device, self.block_size, self.queries_per_kv
        tokens, which, n = self._select_tokens(seqs)
        seq = torch.tensor(seqs, dtype=torch.long, device=device).index_select(0, which)
        slots = self.slot_mapping.index_select(0, tokens).long()
        num_tiles = n + 1  # the last tile is padding: no blocks, zero output
        # Read by the mask in the token's own block: it sees the slots up to its own. Static size (above).
        limit = torch.zeros(ONE_TOKEN_TILE_CAPACITY, dtype=torch.long, device=device)
        limit[:n] = slots
        torch._dynamo.mark_static(limit, 0)

        def sees_up_to_own_slot(b, h, q_idx, kv_idx):
            return kv_idx <= limit[q_idx // rep]

        own_block = F.pad(slots // bs, (0, 1)).to(torch.int32)
        block_mask = _block_mask(
            partial=own_block,
            full_count=F.pad(self.positions.index_select(0, tokens) // bs, (0, 1)),
            full_blocks=F.pad(table.index_select(0, seq), (0, 0, 0, 1)),
            mask_mod=sees_up_to_own_slot,
            tile_rows=rep,
            num_cache_blocks=num_cache_blocks,
            block_size=bs,
        )
        in_order = n == self.num_tokens  # one-token tiles keep the step's order
        rows = torch.arange(n, device=device)
        return _Tiles(tokens, rows, num_tiles, in_order, block_mask)

    def _block_tiles(self, seqs: list[int], table: torch.Tensor, num_cache_blocks: int) -> _Tiles:
        device, bs, rep = self.slot_mapping.device, self.block_size, self.queries_per_kv
        tokens, which, n = self._select_tokens(seqs)
        # Each sequence's queries cover logical blocks first..last; each such block is one tile.
        first = [(self.context_lens[s] - self.query_lens[s]) // bs for s in seqs]
        count = [(self.context_lens[s] - 1) // bs - f + 1 for s, f in zip(seqs, first, strict=True)]
        tile_starts = [0, *accumulate(count)][:-1]
        num_tiles = sum(count)
        per_seq = torch.tensor(
            [seqs, count, [t - f for t, f in zip(tile_starts, first, strict=True)]],
            dtype=torch.long,
            device=device,
        )
        tile_seq = torch.repeat_interleave(per_seq[0], per_seq[1], output_size=num_tiles)
        # Logical block of each tile: its index minus its sequence's first tile, plus its first block.
        tile_block = torch.arange(num_tiles, device=device) - torch.repeat_interleave(
            per_seq[2], per_seq[1], output_size=num_tiles
        )
        # A token at position p sits in its sequence's tile for block p // bs, at row p % bs of it.
        rows = self.positions.index_select(0, tokens) + per_seq[2].index_select(0, which) * bs

        def sees_up_to_own_offset(b, h, q_idx, kv_idx):
            # Only evaluated on a tile's own block, where key offset and query row are comparable.
            return kv_idx % bs <= (q_idx // rep) % bs

        full_blocks = table.index_select(0, tile_seq)
        own_block = full_blocks.gather(1, tile_block[:, None]).squeeze(1)
        block_mask = _block_mask(
            partial=F.pad(own_block, (0, 1)),
            full_count=F.pad(tile_block, (0, 1)),
            full_blocks=F.pad(full_blocks, (0, 0, 0, 1)),
            mask_mod=sees_up_to_own_offset,
            tile_rows=bs * rep,
            num_cache_blocks=num_cache_blocks,
            block_size=bs,
        )
        return _Tiles(tokens, rows, (num_tiles + 1) * bs, False, block_mask)


def _block_mask(
    partial: torch.Tensor,  # [tiles] the one block per tile where mask_mod decides (padding tile last)
    full_count: torch.Tensor,  # [tiles] how many blocks the tile sees whole
    full_blocks: torch.Tensor,  # [tiles, columns] those blocks first in each row
    mask_mod,
    tile_rows: int,
    num_cache_blocks: int,
    block_size: int,
) -> BlockMask:
    num_tiles = partial.shape[0]
    partial_count = torch.ones(num_tiles, dtype=torch.int32, device=partial.device)
    partial_count[-1] = 0
    # The kernel asserts the partial index table spans every key block; a stride-0 view spans them
    # without storing [tiles, num_cache_blocks] (only column 0 is ever read).
    partial_blocks = partial.to(torch.int32)[:, None].expand(num_tiles, num_cache_blocks)
    return BlockMask.from_kv_blocks(
        partial_count.view(1, 1, num_tiles),
        partial_blocks.view(1, 1, num_tiles, num_cache_blocks),
        full_count.to(torch.int32).view(1, 1, num_tiles),
        full_blocks.view(1, 1, *full_blocks.shape),
        BLOCK_SIZE=(tile_rows, block_size),
        mask_mod=mask_mod,
        seq_lengths=(num_tiles * tile_rows, num_cache_blocks * block_size),
        compute_q_blocks=False,  # the transposed (backward) index would be [tiles, num_cache_blocks]
    )


class PagedAttention(torch.nn.Module):
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
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [T, heads, d]
        _, num_blocks, block_size, kvh, d = kv_cache.shape
        slots = kv_cache.view(2, num_blocks * block_size, kvh * d)
        slots[0].index_copy_(0, md.slot_mapping, k.reshape(-1, kvh * d))
        slots[1].index_copy_(0, md.slot_mapping, v.reshape(-1, kvh * d))
        if flex_supported(kv_cache.dtype, kv_cache.device):
            return self._attend_flex(q, kv_cache, md)
        return self._attend_each_sequence(q, kv_cache, md)

    def _attend_flex(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        _, num_blocks, block_size, kvh, d = kv_cache.shape
        # The cache as one sequence of slots per KV head: views, no copy.
        keys = kv_cache[0].view(1, num_blocks * block_size, kvh, d).permute(0, 2, 1, 3)
        values = kv_cache[1].view(1, num_blocks * block_size, kvh, d).permute(0, 2, 1, 3)
        out = None
        for t in md.tiles(num_blocks):
            n = t.tokens.shape[0]
            folded = q.new_zeros(kvh, t.num_rows, self.rep, d)  # rows ordered (token row, head in group)
            if t.in_order:
                folded[:, :n] = q.view(n, kvh, self.rep, d).transpose(0, 1)
            else:
                folded.index_copy_(
                    1, t.rows, q.index_select(0, t.tokens).view(n, kvh, self.rep, d).transpose(0, 1)
                )
            # Sizes that happen to be equal on the first call must not be fused into one symbol.
            with fx_config.patch(use_duck_shape=False):
                o = _compiled_flex()(
                    folded.view(1, kvh, t.num_rows * self.rep, d),
                    keys,
                    values,
                    block_mask=t.block_mask,
                    scale=self.scale,
                )
            o = o.view(kvh, t.num_rows, self.rep, d)
            o = (o[:, :n] if t.in_order else o.index_select(1, t.rows)).transpose(0, 1)
            if t.in_order:
                return o.reshape(n, self.num_heads, d)
            if out is None:
                out = q.new_empty(md.num_tokens, self.num_heads, d)
            out.index_copy_(0, t.tokens, o.reshape(n, self.num_heads, d))
        return out

    def _attend_each_sequence(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        _, _, block_size, kvh, d = kv_cache.shape
        out = torch.empty_like(q)
        for seq, (start, q_len, c_len) in enumerate(
            zip(md.token_starts, md.query_lens, md.context_lens, strict=True)
        ):
            blocks = md.block_table[seq, : -(-c_len // block_size)]
            keys = kv_cache[0].index_select(0, blocks).view(-1, kvh, d)[:c_len].transpose(0, 1)
            values = kv_cache[1].index_select(0, blocks).view(-1, kvh, d)[:c_len].transpose(0, 1)
            mask = None
            if q_len > 1:  # query j sits at position c_len - q_len + j and sees keys up to it
                key_pos = torch.arange(c_len, device=q.device)
                mask = key_pos <= torch.arange(c_len - q_len, c_len, device=q.device)[:, None]
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
