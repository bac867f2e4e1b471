"""What one group of layers keeps in the KV cache per token, and what it can let go of.

vLLM v1's seam (vllm/v1/kv_cache_interface.py, FullAttentionSpec / SlidingWindowSpec): a model's layers
fall into groups of one kind, every group holds its own block table per sequence, and every group takes
its blocks from the one pool. The block manager asks a group's spec what a sequence costs and which of its
blocks no later query reads; it never asks which kind a group is.

One pool block is one page of `layers_per_block` layers (the same for every group: the workers lay out
that many cache tensors and group g's j-th layer uses tensor j), so a block costs the same whichever group
holds it, and one budget serves them all. A model whose layers are all of one kind is one group holding
every layer: a pool block is then every layer's page, as it always was.

Plain Python, shared by the scheduler (which blocks each group's table holds) and the workers (which
cache tensor each layer reads): both build the layout from the same per-layer windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A table entry whose block went back to the pool (outside every later query's window): never hashed,
# shared, swapped or freed.
HOLE = -1


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class FullAttentionSpec:
    """Every query reads every key before it: no block is let go while the sequence runs."""

    block_size: int

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return 0

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens computed tokens holds between steps."""
        return blocks_for(num_tokens, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A query at position q reads the keys at (q - window, q] (Mistral's and Gemma's rule,
    shard_worker/attention/reference.py). Later queries sit at num_computed_tokens and beyond, so the
    blocks wholly before num_computed_tokens - window + 1 are never read again."""

    block_size: int
    window: int

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"sliding window must be at least 1 token, got {self.window}")

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def blocks_held(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size) - self.first_needed_block(num_tokens)


@dataclass(frozen=True)
class MLASpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): every query reads every token before it, as in full
    attention, so the same blocks are held; but a token's page is one latent of latent_dim values
    (kv_lora_rank + qk_rope_head_dim) that every head reads, not a key and a value per KV head, and it
    is the same on every tensor-parallel rank (the latent is replicated; the heads are split)."""

    latent_dim: int = 0

    def __post_init__(self):
        if self.latent_dim < 1:
            raise ValueError(f"an MLA latent must hold at least 1 value a token, got {self.latent_dim}")


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Linear-attention layers (Qwen3-Next's Gated DeltaNet; Mamba-like layers alike): a fixed slot per
    sequence whatever its length, holding every such layer's state (the short convolution's last inputs
    and the delta rule's matrix). Not paged: a sequence takes one slot at admission and gives it back
    once, on finish, abort or preemption (a swap copies it to a host slot). A prefix cannot be reused
    from blocks, since the state after a prefix is not kept (vLLM keeps it at block boundaries; we skip
    reuse for these models and say so at start-up)."""

    slot_bytes: int  # one sequence's state on one rank, every recurrent layer
    num_slots: int  # slots the pool holds (the sequences that can run at once)
    num_host_slots: int = 0  # swap space for the states of swapped-out sequences


def split_budget(budget_bytes: int, block_bytes: int, slot_bytes: int, max_num_seqs: int) -> tuple[int, int]:
    """(KV blocks, state slots) from one budget: a slot for each of max_num_seqs sequences, or as many as
    the budget holds with one block beside each; the rest of the budget in blocks."""
    if not slot_bytes:
        return budget_bytes // block_bytes, 0
    slots = min(max_num_seqs, budget_bytes // (slot_bytes + block_bytes))
    return (budget_bytes - slots * slot_bytes) // block_bytes, slots


def sequences_with_state(pool_blocks: int, blocks_per_seq: int, num_slots: int | None) -> int:
    """Sequences held at once when each needs blocks_per_seq blocks and (num_slots not None) a slot."""
    held = pool_blocks // max(1, blocks_per_seq)
    return held if num_slots is None else min(held, num_slots)


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layers: tuple[int, ...]  # the model's layer indices; the j-th uses the workers' cache tensor j


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups of a model's layers, and the pages a pool block holds."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # cache tensors the workers keep; a pool block is one page of each

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def tensor_of(self, layer: int) -> int:
        """The cache tensor a layer reads and writes."""
        for g in self.groups:
            if layer in g.layers:
                return g.layers.index(layer)
        raise KeyError(f"layer {layer} is in no group")

    def blocks_held(self, num_tokens: int) -> int:
        """Pool blocks one sequence of num_tokens computed tokens holds between steps, every group."""
        return sum(g.spec.blocks_held(num_tokens) for g in self.groups)


def group_layers(
    windows: list[int | None], block_size: int, latent_dims: list[int] | tuple[int, ...] = ()
) -> KVCacheLayout:
    """The layout of a model whose layer i attends over windows[i] tokens (None: every token before it),
    and caches a latent of latent_dims[i] values a token (MLA; 0 or absent: K and V per head).

    Layers of one kind share a group; every group holds the same number of layers, the fewest any kind
    has (vLLM's rule), so that a pool block is the same page whichever group takes it. A kind whose count
    is not a multiple of that fills its last group with fewer layers (that group's unused pages are the
    cost, said by `padding`). Full-attention groups come first: group 0 is the one every token keeps, the
    one the prefix cache names and swaps whole."""
    if not windows:
        raise ValueError("a model with no attention layers has no KV cache layout")
    latents = list(latent_dims) or [0] * len(windows)
    if len(latents) != len(windows):
        raise ValueError(f"{len(latents)} latent widths for {len(windows)} layers")
    if any(latents) and len(set(latents)) > 1:
        # A pool block is one page of each cache tensor, shared by the groups: pages of one size only.
        raise ValueError(
            f"layers caching latents of widths {sorted(set(latents))} in one model are not served"
        )
    kinds: dict[tuple[int | None, int], list[int]] = {}
    for layer, (w, latent) in enumerate(zip(windows, latents, strict=True)):
        if w is not None and latent:
            raise ValueError(f"layer {layer}: a sliding window over an MLA latent is not served")
        kinds.setdefault((w, latent), []).append(layer)
    size = min(len(v) for v in kinds.values())
    groups = []
    for w, latent in sorted(kinds, key=lambda k: (k[0] is not None, k[0] or 0, k[1])):
        if latent:
            spec = MLASpec(block_size, latent)
        else:
            spec = FullAttentionSpec(block_size) if w is None else SlidingWindowSpec(block_size, w)
        layers = kinds[(w, latent)]
        groups += [KVCacheGroup(spec, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    return KVCacheLayout(tuple(groups), size)


def from_describe(layer_windows, block_size: int, layer_latent_dims=()) -> KVCacheLayout | None:
    """The layout of a worker's DescribeResponse.layer_windows (0: full attention) and layer_latent_dims
    (0 or absent: K and V per head); None when every layer is full attention over K and V (one group of
    every layer: the pool as it always was)."""
    windows = [w or None for w in layer_windows]
    latents = list(layer_latent_dims)
    if all(w is None for w in windows) and not any(latents):
        return None
    return group_layers(windows, block_size, latents)


def padding(layout: KVCacheLayout) -> int:
    """Pages per pool block that no layer uses (the short last group of a kind)."""
    return max(layout.layers_per_block - len(g.layers) for g in layout.groups)


def num_blocks(budget_bytes: int, layout: KVCacheLayout, page_bytes: int) -> int:
    """Pool blocks a budget holds: each block is layers_per_block pages of page_bytes (one layer's K and
    V for block_size tokens)."""
    return budget_bytes // (layout.layers_per_block * page_bytes)


def sequences_held(pool_blocks: int, layout: KVCacheLayout, num_tokens: int) -> int:
    """How many sequences of num_tokens tokens the pool holds at once (the capacity a spec really has)."""
    return pool_blocks // layout.blocks_held(num_tokens)


def summary(layout: KVCacheLayout) -> str:
    """One line for the log: the groups and what each keeps."""
    parts = []
    for g in layout.groups:
        if isinstance(g.spec, MLASpec):
            kind = f"MLA latent {g.spec.latent_dim}"
        else:
            kind = "full" if isinstance(g.spec, FullAttentionSpec) else f"sliding {g.spec.window}"
        parts.append(f"{kind} x{len(g.layers)}")
    gcd = math.gcd(*(len(g.layers) for g in layout.groups))
    return f"{layout.num_groups} KV groups ({', '.join(parts)}), {layout.layers_per_block} pages a block" + (
        "" if gcd == layout.layers_per_block else f", {padding(layout)} unused"
    )
