"""The one name of a full KV block, shared by the scheduler's prefix cache and the router's cache index.

A block's hash is chained: SHA-256 over its parent block's hash, the block's `extra` key and its
block_size token ids, so the hash names the whole prefix up to and including the block. The scheduler
registers computed blocks under it (scheduler/block_manager.py) and reports the hashes it stores and
evicts (common/kv_events.py); the router hashes a request's prompt the same way and looks the hashes up
in what each replica reported (router/cache_index.py). Both sides must agree bit for bit, in different
processes, so nothing here depends on the process: no Python hash() (salted per process for str and
bytes), tokens packed as little-endian int64 whatever the platform.

Cryptographic rather than cheap: a collision would hand a request another prompt's KV and silently
change its output, and a client could craft one against a weak hash. With SHA-256 a hit needs no token
comparison.

`extra`: whatever a block's KV depends on besides its tokens and its prefix (a LoRA adapter's id, when
adapters exist: the same tokens under another adapter have other keys and values). It is mixed into
every block, length-prefixed so that (extra, tokens) pairs cannot alias. b"" for the base model.

Images: every placeholder token of an image has the same id, so tokens alone would name two prompts with
the same text and different pictures alike and hand one picture's KV to the other. A block that holds any
of an image's placeholders has the image's (offset, length, content hash) in its extra key (vLLM's rule),
and through the chain every later block depends on it too.

Plain Python: no torch, no gRPC.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

# The parent of a prompt's first block.
ROOT = b""


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens in a prompt: token_ids[offset : offset + length]."""

    offset: int
    length: int
    hash: bytes  # the decoded image's content hash (router/media/decode.py)

    def key(self) -> bytes:
        return struct.pack("<QQ", self.offset, self.length) + self.hash


def block_extra(extra: bytes, images: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The extra key of the block over tokens [start, end): extra and the images whose placeholders it
    holds, in prompt order."""
    keys = [im.key() for im in images if im.offset < end and start < im.offset + im.length]
    return extra + b"".join(keys) if keys else extra


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The hash of one full block: its parent's hash (ROOT for the first), its extra key, its tokens."""
    head = struct.pack("<I", len(extra)) + extra
    return hashlib.sha256(parent + head + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int | None = None,
    extra: bytes = b"",
    known: Sequence[bytes] = (),
    images: Sequence[ImageSpan] = (),
) -> list[bytes]:
    """The chained hashes of the first num_blocks full blocks of token_ids (default: every full block).

    known: hashes of the leading blocks already computed (a sequence's, kept between steps); they are
    reused and only the blocks after them are hashed. images: the prompt's images, mixed into the blocks
    that hold their placeholders."""
    full = len(token_ids) // block_size
    n = full if num_blocks is None else min(num_blocks, full)
    hashes = list(known[:n])
    start = len(hashes)
    if start >= n:
        return hashes
    # The tokens packed once, then hashed a block at a time (hash_block's bytes exactly): about 5x
    # faster than packing each block, which matters on the router's event loop for long prompts.
    plain = struct.pack("<I", len(extra)) + extra
    packed = struct.pack(f"<{(n - start) * block_size}q", *token_ids[start * block_size : n * block_size])
    width = 8 * block_size
    for i in range(n - start):
        parent = hashes[-1] if hashes else ROOT
        head = plain
        if images:
            first = (start + i) * block_size
            key = block_extra(extra, images, first, first + block_size)
            head = struct.pack("<I", len(key)) + key
        hashes.append(hashlib.sha256(parent + head + packed[i * width : (i + 1) * width]).digest())
    return hashes


def adapter_extra(lora_name: str) -> bytes:
    """The extra key of a request's blocks: its LoRA adapter's name (a --lora-modules NAME, the same on
    the router and every replica), b"" for the base model."""
    return lora_name.encode()


def matchable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a prompt of num_tokens may come from a prefix cache: never the
    last token's block, since the step must compute that token to have logits to sample from."""
    return max(0, num_tokens - 1) // block_size
