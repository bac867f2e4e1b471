"""The vision encoder's outputs, kept by image hash: the same picture in another request is not encoded
again, and an image's output stays while any sequence still has placeholders of it to compute.

A chunk that reaches an image's first placeholder needs the encoder's rows for the whole image (the
scheduler never splits an image across chunks, scheduler/images.py, but a later chunk may hold the
rest of an image whose first blocks came from the prefix cache). So the worker takes the output when a
sequence's chunk first touches the image and holds it for that sequence until the image's last
placeholder is computed (release), then it is only cached: evicted least recently used first when the
byte budget is exceeded, never while held. Plain Python over any value with `nbytes` (a tensor's
untyped_storage().nbytes(), a numpy array's nbytes): no torch here, so it is unit tested directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class EncoderCache:
    def __init__(self, max_bytes: int, size_of: Callable[[Any], int] = lambda v: v.nbytes):
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[bytes, Any] = OrderedDict()  # least recently used first
        self._holders: dict[bytes, set[int]] = {}  # image hash -> sequences still computing its tokens
        self.bytes = 0
        self.encodes = 0  # encoder runs (the counter the worker's metric reports)
        self.hits = 0

    def take(self, image_hash: bytes, seq_id: int, encode: Callable[[], Any]) -> Any:
        """The image's encoder output, held for seq_id: from the cache, or encode() once and kept."""
        value = self._entries.get(image_hash)
        if value is None:
            value = encode()
            self.encodes += 1
            self._entries[image_hash] = value
            self.bytes += self._size_of(value)
        else:
            self.hits += 1
            self._entries.move_to_end(image_hash)
        self._holders.setdefault(image_hash, set()).add(seq_id)
        self._evict()
        return value

    def release(self, image_hash: bytes, seq_id: int) -> None:
        """seq_id computed the image's last placeholder (or was forgotten): the output is only cached now."""
        holders = self._holders.get(image_hash)
        if holders is not None:
            holders.discard(seq_id)
            if not holders:
                del self._holders[image_hash]
        self._evict()

    def forget(self, seq_id: int) -> None:
        """Every image seq_id held (it finished, was aborted or preempted)."""
        for image_hash in [h for h, seqs in self._holders.items() if seq_id in seqs]:
            self.release(image_hash, seq_id)

    def __contains__(self, image_hash: bytes) -> bool:
        return image_hash in self._entries

    def _evict(self) -> None:
        """Least recently used first, skipping held entries; held ones may exceed the budget (the step
        needs them), which the next release brings back under."""
        for image_hash in list(self._entries):
            if self.bytes <= self.max_bytes:
                return
            if image_hash in self._holders:
                continue
            self.bytes -= self._size_of(self._entries.pop(image_hash))
