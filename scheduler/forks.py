"""Several choices of one request (n, best_of): every choice is a sequence of its own, and those after the
first share the first one's prompt blocks instead of computing them again. Plain Python.

A choice names the first one (fork_of) and waits in the queue until the first choice has computed its
prompt up to its share point: its full blocks before the last prompt token. It then takes a reference to
those blocks (BlockManager.share) and computes only the rest of its prompt, at most a block, for the logits
it samples its first token from. Full blocks never change again, so sharing needs no copy on write, and
works with the prefix cache off. The first choice stops at its share point while others wait for it, so
the blocks are still held when they are admitted, even when it would finish in the step that completes its
prompt. A choice whose first choice is gone (finished, swapped out) is computed alone.
"""

from __future__ import annotations

from scheduler.sequence import Sequence, SequenceStatus


def share_point(seq: Sequence, block_size: int) -> int:
    """Prompt tokens the other choices of seq's request can share."""
    return (seq.num_prompt_tokens - 1) // block_size * block_size


def waits(seq: Sequence, block_size: int) -> bool:
    """Whether a choice waits for its first choice's prompt blocks, still to be computed."""
    first = seq.fork_of
    if first is None or first.status is SequenceStatus.WAITING:
        return first is not None
    return first.status is SequenceStatus.RUNNING and first.num_computed_tokens < share_point(
        first, block_size
    )


def share(seq: Sequence, blocks) -> int:
    """Gives seq (holding no blocks) a share of its first choice's computed prompt blocks; the tokens
    they hold (0: nothing to share)."""
    first = seq.fork_of
    if first is None or first.status is not SequenceStatus.RUNNING:
        return 0
    return blocks.share(seq, first, share_point(first, blocks.block_size))


def unfork(seq: Sequence) -> None:
    """seq no longer waits for its first choice (admitted, or ended)."""
    if seq.fork_of is not None:
        seq.fork_of.forks_waiting -= 1
        seq.fork_of = None


def limit(seq: Sequence, num_new: int, start: int, block_size: int) -> int:
    """num_new tokens from start, cut at seq's share point while other choices wait for it."""
    point = share_point(seq, block_size)
    return min(num_new, point - start) if seq.forks_waiting and start < point else num_new
