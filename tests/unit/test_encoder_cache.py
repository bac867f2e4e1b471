"""The shard worker's encoder-output cache (shard_worker/encoder_cache.py): one encode per picture,
outputs held while a sequence needs them, least recently used evicted under the byte budget."""

import numpy as np

from shard_worker.encoder_cache import EncoderCache


def output(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.uint8)  # n bytes


def test_the_same_image_is_encoded_once_across_sequences():
    cache = EncoderCache(max_bytes=1000)
    calls = []

    def encode():
        calls.append(1)
        return output(100)

    a = cache.take(b"cat", 1, encode)
    assert cache.take(b"cat", 2, encode) is a
    cache.release(b"cat", 1)
    cache.forget(2)
    assert cache.take(b"cat", 3, encode) is a  # released, still cached
    assert (cache.encodes, cache.hits, len(calls)) == (1, 2, 1)


def test_held_outputs_survive_the_budget_and_the_least_recent_go_first():
    cache = EncoderCache(max_bytes=250)
    for i, name in enumerate((b"a", b"b")):
        cache.take(name, i, lambda: output(100))
    cache.release(b"a", 0)
    cache.release(b"b", 1)
    cache.take(b"a", 5, lambda: output(100))  # a is now the most recent
    cache.take(b"c", 6, lambda: output(100))  # over budget: b (least recent, unheld) goes
    assert b"b" not in cache and b"a" in cache and b"c" in cache and cache.bytes == 200
    cache.take(b"d", 7, lambda: output(200))  # a, c and d all held: over budget until released
    assert cache.bytes == 400
    cache.forget(5)  # a released: it goes, c and d are still held
    assert b"a" not in cache and cache.bytes == 300
    cache.forget(6)
    assert b"c" not in cache and b"d" in cache and cache.bytes == 200
    assert (cache.encodes, cache.hits) == (4, 1)
