"""Paged attention on CPU with torch's compiled flex_attention, reading keys and values in place.

The whole cache of a layer is one long key sequence ([num_blocks * block_size] slots) and the step's
tokens are the queries; flex_attention (compiled to C++ on CPU) runs over it with a block-sparse mask
built directly from the block tables. The mask's key block is our cache block, so every query tile lists
the physical blocks of its own sequence: the ones it sees whole ("full": no mask is evaluated there) and
the one or two it sees in part ("partial": a mask_mod decides per key). Nothing is gathered, no query is
padded to another sequence's length, and the mask metadata grows with the step's tokens times blocks per
sequence, never with queries x keys or with the number of sequences x context.

Query heads that share a KV head are folded into the query rows ([kv_heads, tokens * rep, d]), so one
tile loads each key block once for all of its heads. Tokens are tiled two ways, one flex call each:
- one token per tile (decodes and short queries): its partial block is the token's own block, where it
  sees the slots up to its own slot; with a sliding window, also the block where the window starts,
  where it sees the offsets from the window's first key on. Blocks wholly before the window are not in
  the tile's lists, so they are never read;
- sixteen positions per tile, aligned to the sequence's blocks (prefill chunks of PREFILL_MIN_QUERY
  tokens or more, in layers without a window): a tile's partial block is the block it covers, where row
  r sees offsets <= r. Up to block_size - 1 rows at either end of a chunk are padding, and tiles amortise
  each key block over 16 queries: 1.2-2.7x faster than one-token tiles on prefill-heavy steps on CPU.
  Windowed layers tile every token one per tile (a block tile's rows would each start their window in
  a different place).
Each call's graph is compiled once with dynamic shapes (every size that varies per step is kept >= 2 by a
padding tile and a padding column, so no size is specialised to 1) and serves every later step.

CPU float32 only (see FlexBackend.unsupported).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from shard_worker.attention.backend import AttentionBackend, AttentionContext, StepBatch
from shard_worker.attention.kv_dtype import load

# A sequence with at least this many query tokens in a step is tiled by blocks; shorter ones one token per
# tile. Measured on CPU, 32 sequences at context 2048, one-token vs block tiles: 8-token queries 148 vs
# 110 ms, 4-token 115 vs 124 ms, decodes 58 vs 124 ms.
PREFILL_MIN_QUERY = 8
# One-token tiles read their own slot (and their window's start) from buffers of this static size (a
# buffer sized by the step would give the compiled mask a dynamic size, which inductor's CPU template
# mis-generates: its `cur_qSplitSize` substitution is a plain text replace that can clobber another
# size's name). Short queries beyond it go to block tiles, which are exact too; a windowed layer whose
# step has more tokens than this is attended by the reference path.
ONE_TOKEN_TILE_CAPACITY = 4096


# Distinct graphs of the one compiled call: a mask kind (one-token, block, windowed one-token) per group
# size and head_dim the process serves, each compiled once. Past dynamo's default limit of 8 it would
# silently run flex_attention eagerly, which is both slow and wrong for these block masks (the eager path
# reads the index tables whole); a hit is an error instead.
RECOMPILE_LIMIT = 64


# Threads whose compiler settings are set (below). torch 2.13 keeps dynamo's and fx's settings per thread,
# and a worker warms up in one gRPC thread and steps in another: set only where the first call ran, a
# step thread would compile with duck shapes on and fall back to eager flex after 8 recompiles.
_configured = threading.local()


def _compiled_flex():
    if not getattr(_configured, "done", False):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        # Sizes that happen to be equal on the first call must not be fused into one symbol. Set for the
        # thread, not patched around each call: the patch cost 3% of a batch-1 decode step (30 layers),
        # and this is the only graph a worker compiles.
        fx_config.use_duck_shape = False
        # The layer's scale is a Python float: specialised, not traced as a symbol (which traced flex
        # twice, 1.5-2 s of every start; shard_worker/warm_up.py sets it in its own thread too).
        torch._dynamo.config.specialize_float = True
        _configured.done = True
    return _compiled()


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=True)


@dataclass(frozen=True)
class _Tiles:
    """The queries of one flex call: which step tokens, laid out in which rows, and their block mask."""

    tokens: torch.Tensor  # [n] step rows of the tokens this call computes
    rows: torch.Tensor  # [n] the token row each of them takes in this call's query layout
    num_rows: int  # token rows in the layout, padding included
    in_order: bool  # tokens and rows are both 0..n-1 and n is the whole step: no index ops needed
    block_mask: BlockMask


@dataclass
class FlexMetadata:
    """The step's tilings, built by the first layer that needs each (cache size, group size, window)."""

    batch: StepBatch
    token_starts: tuple[int, ...]
    # One past the highest cache block the step's sequences read (at least 2: a size of 1 would be
    # specialised). Only that prefix of the cache is handed to flex, whose CPU kernel's cost grows with the
    # key length it is given even where the mask skips it: one decode at 2,912 blocks took 141 us a layer,
    # at 160 blocks 86 us.
    used_blocks: int
    tiles: dict[tuple, tuple[_Tiles, ...] | None] = field(default_factory=dict)


class FlexBackend(AttentionBackend):
    name = "flex"

    @classmethod
    def unsupported(cls, device, dtype):
        # CPU half types: the C++ template repacks the whole key and value tensors (here: the whole
        # cache) on every call once it decides packing pays (AMX machines, 64+ query rows). CUDA: the
        # Triton template needs query tiles of at least 16 rows, and one-token tiles are rep rows.
        if device.type != "cpu" or dtype != torch.float32:
            return f"flex attention runs on CPU in float32 only, not {device.type} {str(dtype)[6:]}"
        return None

    def prepare(self, batch: StepBatch) -> FlexMetadata:
        q_lens = batch.query_lens_host.tolist()
        used = max(2, int(batch.block_table.max()) + 1) if batch.block_table.numel() else 2
        return FlexMetadata(batch, tuple([0, *accumulate(q_lens)][:-1]), used)

    def attend(self, layer, q: torch.Tensor, kv_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        md: FlexMetadata = ctx.metadata
        _, cache_blocks, block_size, kvh, d = kv_cache.shape
        num_blocks = min(md.used_blocks, cache_blocks)
        rep, window = layer.queries_per_kv, layer.sliding_window
        key = (num_blocks, rep, window)
        if key not in md.tiles:
            md.tiles[key] = _Tiling(md, rep, num_blocks, window).build()
        tilings = md.tiles[key]
        if tilings is None:  # a windowed layer beyond the one-token capacity
            from shard_worker.attention.reference import ReferenceBackend

            ref = ReferenceBackend(self.device, self.dtype)
            return ref.attend(layer, q, kv_cache, AttentionContext(ref, md.batch, ref.prepare(md.batch)))
        # The cache's used prefix as one sequence of slots per KV head: views, no copy.
        # A cache narrower than the model's dtype is read as the model's: its used prefix upcast (a copy).
        keys = load(kv_cache[0, :num_blocks], q.dtype, layer.k_scale)
        values = load(kv_cache[1, :num_blocks], q.dtype, layer.v_scale)
        keys = keys.view(1, num_blocks * block_size, kvh, d).permute(0, 2, 1, 3)
        values = values.view(1, num_blocks * block_size, kvh, d).permute(0, 2, 1, 3)
        out = None
        for t in tilings:
            n = t.tokens.shape[0]
            folded = q.new_zeros(kvh, t.num_rows, rep, d)  # rows ordered (token row, head in group)
            if t.in_order:
                folded[:, :n] = q.view(n, kvh, rep, d).transpose(0, 1)
            else:
                folded.index_copy_(
                    1, t.rows, q.index_select(0, t.tokens).view(n, kvh, rep, d).transpose(0, 1)
                )
            o = _compiled_flex()(
                folded.view(1, kvh, t.num_rows * rep, d),
                keys,
                values,
                block_mask=t.block_mask,
                scale=layer.scale,
            )
            o = o.view(kvh, t.num_rows, rep, d)
            o = (o[:, :n] if t.in_order else o.index_select(1, t.rows)).transpose(0, 1)
            if t.in_order:
                return o.reshape(n, layer.num_heads, d)
            if out is None:
                out = q.new_empty(md.batch.num_tokens, layer.num_heads, d)
            out.index_copy_(0, t.tokens, o.reshape(n, layer.num_heads, d))
        return out


class _Tiling:
    """Builds the flex calls of one step for one (cache size, queries per KV head, window)."""

    def __init__(self, md: FlexMetadata, rep: int, num_cache_blocks: int, window: int | None):
        self.batch, self.token_starts = md.batch, md.token_starts
        self.rep, self.num_cache_blocks, self.window = rep, num_cache_blocks, window
        self.bs = md.batch.block_size
        self.query_lens = md.batch.query_lens_host.tolist()
        self.context_lens = md.batch.seq_lens_host.tolist()

    def build(self) -> tuple[_Tiles, ...] | None:
        one_token, by_block, taken = [], [], 0
        for seq, q in enumerate(self.query_lens):
            if (self.window is not None or q < PREFILL_MIN_QUERY) and taken + q < ONE_TOKEN_TILE_CAPACITY:
                one_token.append(seq)
                taken += q
            elif self.window is not None:
                return None
            else:
                by_block.append(seq)
        # One column and one tile of padding: the compiled graph then never sees a size of 1, which
        # would specialise it (and recompile when the size moves).
        table = F.pad(self.batch.block_table, (0, 1))
        tiles = []
        if one_token:
            tiles.append(self._one_token_tiles(one_token, table))
        if by_block:
            tiles.append(self._block_tiles(by_block, table))
        return tuple(tiles)

    def _select_tokens(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Step rows of the given sequences' tokens (in order), and each one's index into seqs."""
        device = self.batch.positions.device
        q_lens = [self.query_lens[s] for s in seqs]
        n = sum(q_lens)
        local_starts = [0, *accumulate(q_lens)][:-1]
        per_seq = torch.tensor(
            [[self.token_starts[s] - a for s, a in zip(seqs, local_starts, strict=True)], q_lens],
            dtype=torch.long,
            device=device,
        )
        which = _repeat(np.arange(len(seqs)), q_lens)
        tokens = per_seq[0].index_select(0, which) + torch.arange(n, device=device)
        return tokens, which, n

    def _one_token_tiles(self, seqs: list[int], table: torch.Tensor) -> _Tiles:
        device, bs, rep = self.batch.positions.device, self.bs, self.rep
        tokens, which, n = self._select_tokens(seqs)
        seq = torch.tensor(seqs, dtype=torch.long, device=device).index_select(0, which)
        slots = self.batch.slot_mapping.index_select(0, tokens)
        positions = self.batch.positions.index_select(0, tokens)
        own = positions // bs  # logical block of the token's own slot
        rows = table.index_select(0, seq)
        # Read by the mask in the token's own block: it sees the slots up to its own. Static size (above).
        limit = torch.zeros(ONE_TOKEN_TILE_CAPACITY, dtype=torch.long, device=device)
        limit[:n] = slots
        torch._dynamo.mark_static(limit, 0)
        if self.window is None:
            full_start = torch.zeros_like(own)
            partial = own_block = F.pad(slots // bs, (0, 1))[:, None]

            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= limit[q_idx // rep]

        else:
            # The window's first key, its logical block (seen in part) and the blocks seen whole between.
            first = (positions - self.window + 1).clamp(min=0)
            start_block = first // bs
            full_start = torch.minimum(start_block + 1, own)
            start_phys = rows.gather(1, start_block[:, None]).squeeze(1)
            # The physical block where the window starts (the own block when the window starts there),
            # and the window's first slot in it. The mask compares kv_idx with these only (arithmetic on
            # kv_idx in a mask trips inductor's CPU template, as above).
            lo_block = torch.where(start_block < own, start_phys, slots // bs)
            lo_base = torch.zeros(ONE_TOKEN_TILE_CAPACITY, dtype=torch.long, device=device)
            lo_base[:n] = lo_block * bs
            lo_first = torch.zeros(ONE_TOKEN_TILE_CAPACITY, dtype=torch.long, device=device)
            lo_first[:n] = lo_block * bs + first % bs
            own_base = torch.zeros(ONE_TOKEN_TILE_CAPACITY, dtype=torch.long, device=device)
            own_base[:n] = slots - slots % bs
            for buffer in (lo_base, lo_first, own_base):
                torch._dynamo.mark_static(buffer, 0)
            own_block = F.pad(slots // bs, (0, 1))[:, None]
            start = F.pad(torch.where(start_block < own, start_phys, -1), (0, 1), value=-1)[:, None]
            partial = torch.cat([own_block, start], dim=1)

            def mask_mod(b, h, q_idx, kv_idx):
                r = q_idx // rep
                in_own = (kv_idx >= own_base[r]) & (kv_idx < own_base[r] + bs)
                in_start = (kv_idx >= lo_base[r]) & (kv_idx < lo_base[r] + bs)
                return (~in_own | (kv_idx <= limit[r])) & (~in_start | (kv_idx >= lo_first[r]))

        block_mask = _block_mask(
            partial=partial,
            full_count=F.pad(own - full_start, (0, 1)),
            full_blocks=F.pad(_shift_rows(rows, full_start), (0, 0, 0, 1)),
            mask_mod=mask_mod,
            tile_rows=rep,
            num_cache_blocks=self.num_cache_blocks,
            block_size=bs,
        )
        in_order = n == self.batch.num_tokens  # one-token tiles keep the step's order
        return _Tiles(tokens, torch.arange(n, device=device), n + 1, in_order, block_mask)

    def _block_tiles(self, seqs: list[int], table: torch.Tensor) -> _Tiles:
        device, bs, rep = self.batch.positions.device, self.bs, self.rep
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
        tile_seq = _repeat(np.asarray(seqs), count)
        # Logical block of each tile: its index minus its sequence's first tile, plus its first block.
        offsets = [t - f for t, f in zip(tile_starts, first, strict=True)]
        tile_block = torch.arange(num_tiles, device=device) - _repeat(np.asarray(offsets), count)
        # A token at position p sits in its sequence's tile for block p // bs, at row p % bs of it.
        rows = self.batch.positions.index_select(0, tokens) + per_seq[2].index_select(0, which) * bs

        def sees_up_to_own_offset(b, h, q_idx, kv_idx):
            # Only evaluated on a tile's own block, where key offset and query row are comparable.
            return kv_idx % bs <= (q_idx // rep) % bs

        full_blocks = table.index_select(0, tile_seq)
        own_block = full_blocks.gather(1, tile_block[:, None]).squeeze(1)
        block_mask = _block_mask(
            partial=F.pad(own_block, (0, 1))[:, None],
            full_count=F.pad(tile_block, (0, 1)),
            full_blocks=F.pad(full_blocks, (0, 0, 0, 1)),
            mask_mod=sees_up_to_own_offset,
            tile_rows=bs * rep,
            num_cache_blocks=self.num_cache_blocks,
            block_size=bs,
        )
        return _Tiles(tokens, rows, (num_tiles + 1) * bs, False, block_mask)


def _repeat(values: np.ndarray, counts: list[int]) -> torch.Tensor:
    """values[i] counts[i] times each. numpy's repeat, not torch's CPU repeat_interleave, which runs a
    parallel region for any size and costs milliseconds per call on a loaded machine."""
    return torch.from_numpy(np.repeat(values.astype(np.int64), counts))


def _shift_rows(rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Row i of rows from column start[i] on (padded at the end with the last column)."""
    if not bool((start > 0).any()):
        return rows
    columns = (start[:, None] + torch.arange(rows.shape[1], device=rows.device)).clamp(max=rows.shape[1] - 1)
    return rows.gather(1, columns)


def _block_mask(
    partial: torch.Tensor,  # [tiles, k] blocks where mask_mod decides (-1: none; padding tile last)
    full_count: torch.Tensor,  # [tiles] how many blocks the tile sees whole
    full_blocks: torch.Tensor,  # [tiles, columns] those blocks first in each row
    mask_mod,
    tile_rows: int,
    num_cache_blocks: int,
    block_size: int,
) -> BlockMask:
    num_tiles, k = partial.shape
    partial = partial.to(torch.int32)
    # Each tile's real partial blocks first, then how many there are (the padding tile has none).
    present = partial >= 0
    partial_count = present.sum(1, dtype=torch.int32)
    partial_count[-1] = 0
    order = torch.argsort((~present).to(torch.int8), dim=1, stable=True)
    partial = partial.gather(1, order).clamp(min=0)
    # The kernel asserts the partial index table spans every key block. A strided view spans them
    # without storing [tiles, num_cache_blocks] (only the first partial_count[i] columns of row i are
    # read): with one partial block a tile, a stride-0 view of it; with more, row i starts at its own k
    # entries and runs on into the next rows' (the buffer's tail keeps the last row in bounds).
    if k == 1:
        partial_blocks = partial.expand(num_tiles, num_cache_blocks)
    else:
        buffer = torch.zeros(num_tiles * k + num_cache_blocks, dtype=torch.int32, device=partial.device)
        buffer[: num_tiles * k] = partial.reshape(-1)
        partial_blocks = buffer.as_strided((num_tiles, num_cache_blocks), (k, 1))
    return BlockMask.from_kv_blocks(
        partial_count.view(1, 1, num_tiles),
        partial_blocks.view(1, 1, num_tiles, num_cache_blocks),
        full_count.to(torch.int32).view(1, 1, num_tiles),
        full_blocks.to(torch.int32).view(1, 1, *full_blocks.shape),
        BLOCK_SIZE=(tile_rows, block_size),
        mask_mod=mask_mod,
        seq_lengths=(num_tiles * tile_rows, num_cache_blocks * block_size),
        compute_q_blocks=False,  # the transposed (backward) index would be [tiles, num_cache_blocks]
    )
