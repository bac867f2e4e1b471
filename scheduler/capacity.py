"""How much KV the ranks can hold, agreed across them: blocks, max_model_len, host (swap) blocks.

Plain Python: the ranks' descriptions in, the settled capacity out. Every rank must be able to hold the
pool, so the pool is the smallest rank's; but ranks of one tensor-parallel group hold equal shares of the
same model on equal devices, so a rank that can hold much less than the others is a fault (another
process on its GPU, a smaller device, a misconfigured rank), not something to silently size down to:
past `tolerance` the group is refused with the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.kv_cache_spec import KVCacheLayout, RecurrentStateSpec, blocks_for

# Ranks' block counts may differ by this share of the largest (allocator rounding, NCCL buffers, the
# CUDA context on rank 0) before the group is refused.
CAPACITY_TOLERANCE = 0.10


@dataclass(frozen=True)
class RankCapacity:
    """What one rank reports (its DescribeResponse)."""

    rank: int
    num_kv_blocks: int  # blocks of block_size tokens this rank can hold
    kv_block_bytes: int  # bytes one such block takes on this rank (every layer)
    max_position_embeddings: int
    state_slot_bytes: int = 0  # one sequence's recurrent state on this rank (0: no linear attention)
    num_state_slots: int = 0  # the slots this rank holds beside its blocks


@dataclass(frozen=True)
class Capacity:
    num_blocks: int  # the device pool, the same on every rank
    max_model_len: int  # the longest sequence the scheduler will form
    num_host_blocks: int  # swap space per rank, in blocks (0: none)
    notes: tuple[str, ...] = ()  # what was capped, and why, for the log
    layout: KVCacheLayout | None = None  # the model's layer groups; None: one group of every layer
    state: RecurrentStateSpec | None = None  # a recurrent-state slot per sequence; None: no such layers


class UnfitRanks(ValueError):
    """The ranks answer but cannot serve with this scheduler as they are (their capacity, settings they
    and the scheduler must share, a draft model missing). At start a misconfiguration (one line, exit 2);
    after a loss, the requests in flight fail and the scheduler asks the ranks again. Only this error
    means that: any other in the step loop is a bug, and is not taken for it."""


class CapacityError(UnfitRanks):
    """The ranks cannot serve together (imbalanced), or cannot hold even one sequence."""


def settle(
    ranks: list[RankCapacity],
    *,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int = 0,
    swap_space_gib: float = 0.0,
    tolerance: float = CAPACITY_TOLERANCE,
    layout: KVCacheLayout | None = None,
) -> Capacity:
    """The capacity the scheduler uses. max_model_len 0: the model's context length. layout: the model's
    layer groups (common/kv_cache_spec.py), each holding a table from the one pool: a sequence prefilled
    in one step needs a block per group for each of its blocks, windows or not."""
    num_groups = 1 if layout is None else layout.num_groups
    if not ranks:
        raise CapacityError("no ranks described their capacity")
    counts = [r.num_kv_blocks for r in ranks]
    low, high = min(counts), max(counts)
    if high > 0 and (high - low) / high > tolerance:
        raise CapacityError(
            f"ranks disagree on KV capacity beyond {tolerance:.0%}: blocks per rank {counts} "
            f"(is another process using the device of rank {counts.index(low)}?)"
        )
    notes = []
    num_blocks = low
    model_positions = min(r.max_position_embeddings for r in ranks)
    resolved = max_model_len or model_positions
    if resolved > model_positions:
        notes.append(f"--max-model-len {resolved} is beyond the model's {model_positions} positions: capped")
        resolved = model_positions
    # More blocks than max_num_seqs full-length sequences can use would only take memory.
    useful = max_num_seqs * blocks_for(resolved, block_size) * num_groups
    if num_blocks > useful:
        notes.append(f"pool capped at {useful} blocks: max_num_seqs sequences of max_model_len")
        num_blocks = useful
    if num_blocks < 1:
        raise CapacityError(f"no KV blocks: ranks report {counts}")
    longest = num_blocks // num_groups * block_size
    if longest < resolved:
        notes.append(
            f"the KV pool holds {longest} tokens in each of {num_groups} layer groups, fewer than "
            f"max_model_len {resolved}: max_model_len capped"
        )
        resolved = longest
    if resolved < 1:
        raise CapacityError(f"{num_blocks} KV blocks cannot hold a block in each of {num_groups} groups")
    # Swap space in blocks: the largest block over ranks, so that every rank's copy fits.
    swap_bytes = int(swap_space_gib * 2**30)
    block_bytes = max(r.kv_block_bytes for r in ranks)
    state = _state(ranks, max_num_seqs, swap_bytes, block_bytes)
    if state is not None:  # the host slots come out of the swap space first
        swap_bytes -= state.num_host_slots * state.slot_bytes
    return Capacity(num_blocks, resolved, swap_bytes // block_bytes, tuple(notes), layout, state)


def _state(ranks: list[RankCapacity], max_num_seqs: int, swap_bytes: int, block_bytes: int):
    """The recurrent-state slots every rank holds (the fewest any reports), and as many host slots as
    the swap space holds with a block beside each, up to one per slot."""
    slot_bytes = max(r.state_slot_bytes for r in ranks)
    if not slot_bytes:
        return None
    num_slots = min(min(r.num_state_slots for r in ranks), max_num_seqs)
    if num_slots < 1:
        raise CapacityError(f"no recurrent-state slots: ranks report {[r.num_state_slots for r in ranks]}")
    host = min(num_slots, swap_bytes // (slot_bytes + block_bytes))
    return RecurrentStateSpec(slot_bytes, num_slots, host)
