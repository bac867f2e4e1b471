"""A step's images: which of the step's rows are image placeholders, the vision encoder's output for them
(from the encoder cache, or encoded now), and the spans the attention backends make bidirectional.

An image's encoder output is needed in the step that computes its placeholders. The scheduler never
splits an image across chunks (scheduler/images.py), so a step holds all of an image's remaining
placeholders or none; the rows before them (a prefix-cache hit that ended inside the image) were computed
with the same picture, since the image's hash is in those blocks' hashes. Every image the step needs and
the cache lacks is encoded in one batch; then each one is taken from the cache for its sequence, and
released once its last placeholder is computed (shard_worker/encoder_cache.py).

The vision encoder is replicated: every rank encodes the same pixels to the same rows (no communication),
each writing them into the embeddings its own forward reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shard_worker.encoder_cache import EncoderCache


@dataclass(frozen=True)
class PromptImage:
    """An image of a sequence's prompt as the worker holds it (worker.proto SequenceInit.images)."""

    offset: int  # its first placeholder's position
    length: int  # its placeholders: the encoder's output rows
    hash: bytes  # the picture's content hash: the encoder cache's key
    pixel_values: np.ndarray  # float32, the checkpoint processor's layout for one image


@dataclass(frozen=True)
class StepImages:
    rows: torch.Tensor  # [R] int64: the step's rows (token indices) that are image placeholders
    embeds: torch.Tensor  # [R, hidden]: the encoder's output for them, in the same order
    # Per sequence, in batch order: the (first, end) positions of each image whose placeholders this
    # step computes; queries and keys of one image attend to each other both ways (Gemma 3).
    spans: tuple[tuple[tuple[int, int], ...], ...]


def step_images(inputs, cache: EncoderCache, encode, device: torch.device) -> StepImages | None:
    """The step's image rows and their embeddings; None when it computes no image placeholder.
    encode(pixels [N, ...] float32 tensor) -> [N, tokens, hidden]."""
    sequences = inputs.sequences or ()
    if not any(seq.images for seq in sequences):
        return None
    q_starts = np.cumsum(inputs.query_lens) - inputs.query_lens
    needed = []  # (batch index, sequence, image, first, end): positions [first, end) computed now
    spans: list[tuple[tuple[int, int], ...]] = []
    for i, seq in enumerate(sequences):
        context = int(inputs.context_lens[i])
        start = context - int(inputs.query_lens[i])
        mine = []
        for image in seq.images:
            first, end = max(image.offset, start), min(image.offset + image.length, context)
            if first < end:
                needed.append((i, seq, image, first, end))
                mine.append((image.offset, image.offset + image.length))
        spans.append(tuple(mine))
    if not needed:
        return None
    missing = {im.hash: im for _, _, im, _, _ in needed if im.hash not in cache}
    encoded = {}
    if missing and len({im.pixel_values.shape for im in missing.values()}) == 1:
        pixels = torch.from_numpy(np.stack([im.pixel_values for im in missing.values()])).to(device)
        out = encode(pixels)
        encoded = {h: out[k].clone() if len(missing) > 1 else out[0] for k, h in enumerate(missing)}
    elif missing:  # sizes differ (Qwen VL's dynamic resolution): one batch of one each
        encoded = {
            h: encode(torch.from_numpy(im.pixel_values[None]).to(device))[0] for h, im in missing.items()
        }
    rows, embeds = [], []
    for i, seq, image, first, end in needed:
        value = cache.take(image.hash, seq.seq_id, lambda h=image.hash: encoded[h])
        if value.shape[0] != image.length:
            raise ValueError(
                f"sequence {seq.seq_id}: an image of {image.length} placeholders, and the encoder gave "
                f"{value.shape[0]} rows"
            )
        row0 = int(q_starts[i]) + first - (int(inputs.context_lens[i]) - int(inputs.query_lens[i]))
        rows.append(np.arange(row0, row0 + end - first))
        embeds.append(value[first - image.offset : end - image.offset])
        if end == image.offset + image.length:  # its last placeholder is computed: only cached now
            cache.release(image.hash, seq.seq_id)
    return StepImages(torch.from_numpy(np.concatenate(rows)).to(device), torch.cat(embeds), tuple(spans))
