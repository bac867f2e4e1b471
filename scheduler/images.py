"""Chunked prefill never splits an image: a chunk takes all of an image's placeholder tokens or none.

An image's placeholders attend to one another both ways (Gemma 3's mask, as transformers builds it), so
the first of them cannot be computed before the last is in the same pass; and the worker writes the
encoder's output for the whole image into them at once. A chunk that would end inside an image ends
before it instead; one that starts inside it (the rest of an image whose first blocks came from the
prefix cache) takes the rest whole or waits. An image longer than the step's token budget could never
be scheduled: the replica refuses it when it arrives.

Plain Python: no torch, no gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.sequence import Sequence


def limit(seq: Sequence, num_new: int, start: int) -> int:
    """num_new tokens from start, cut back so that no image's placeholders are split (0: wait)."""
    end = start + num_new
    for image in seq.images:
        first, last = image.offset, image.offset + image.length
        if first < end < last:
            end = max(start, first)
    return end - start


def too_long(image_lengths: Iterable[int], max_num_batched_tokens: int) -> str | None:
    """Why a prompt with images of these lengths (in tokens) can never be scheduled under this token
    budget; None when it can."""
    longest = max(image_lengths, default=0)
    if longest > max_num_batched_tokens:
        return (
            f"an image takes {longest} tokens, more than --max-num-batched-tokens "
            f"{max_num_batched_tokens} (a step computes an image's tokens together)"
        )
    return None
