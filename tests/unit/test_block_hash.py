"""The one block hash (common/block_hash.py): the router and the scheduler name a prefix alike, in any
process, and the scheduler's prefix cache reports what it stores and evicts (common/kv_events.py)."""

import os
import subprocess
import sys

from common.block_hash import ROOT, ImageSpan, block_extra, block_hashes, hash_block, matchable_blocks
from common.kv_events import KvEventLog, KvEvents
from common.pb.tpserve.internal.v1 import scheduler_pb2
from router.in_flight import InFlight
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence
from tests.conftest import ROOT as REPO


def test_hashes_chain_over_the_prefix_and_the_extra_key():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # full blocks only
    assert a[0] == hash_block(ROOT, range(16)) and a[1] == hash_block(a[0], range(16, 32))
    # The same second block after another first block is another prefix.
    assert block_hashes([9, *range(1, 32)], 16)[1] != a[1]
    # An extra key (an adapter) names other KV for the same tokens.
    assert block_hashes(list(range(32)), 16, extra=b"lora-1") != a
    assert block_hashes(list(range(32)), 16, num_blocks=1) == a[:1]
    assert block_hashes(list(range(48)), 16, known=a) == block_hashes(list(range(48)), 16)


def test_the_hash_is_the_same_in_every_process():
    code = "from common.block_hash import block_hashes; print(block_hashes(list(range(64)), 16)[-1].hex())"
    seen = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        seen.add(out.stdout.strip())
    assert seen == {block_hashes(list(range(64)), 16)[-1].hex()}


def test_the_last_token_is_never_matched():
    assert [matchable_blocks(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 1, 1, 2]


def test_the_event_log_keeps_the_net_change():
    log = KvEventLog()
    assert log.take() == KvEvents(reset=True)  # a new cache: routers need a snapshot
    log.stored(b"a")
    log.stored(b"b")
    log.removed(b"b")  # stored and evicted within one step: nothing to say
    log.removed(b"c")
    log.stored(b"c")  # evicted and stored again: nothing either
    log.removed(b"d")
    assert log.take() == KvEvents(stored=(b"a",), removed=(b"d",))
    assert not log.take()


def test_the_block_manager_reports_the_hashes_the_router_computes():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    bm.events.take()
    seq = Sequence(0, "r0", list(range(10)), 10, 4)
    bm.allocate(seq, 10)
    seq.num_computed_tokens = 10
    bm.register_full_blocks(seq)
    assert set(bm.events.take().stored) == set(block_hashes(seq.token_ids, 4)) == set(bm.cached_hashes())
    bm.free(seq)
    other = Sequence(1, "r1", [7] * 12, 12, 4)
    bm.allocate(other, 12)  # takes every block: the two cached ones are evicted
    assert set(bm.events.take().removed) == set(block_hashes(seq.token_ids, 4))
    assert bm.cached_hashes() == []


# ---- images: same placeholder tokens, other picture, other KV ----

IMAGE_TOKEN = 99


def image_prompt(image_at: int = 6, length: int = 5, total: int = 20) -> list[int]:
    ids = list(range(total))
    ids[image_at : image_at + length] = [IMAGE_TOKEN] * length
    return ids


def test_blocks_holding_an_images_placeholders_name_the_image():
    ids = image_prompt()  # the image's placeholders are tokens 6..10: blocks 1 and 2 of size 4
    cat, dog = ImageSpan(6, 5, b"cat" * 11), ImageSpan(6, 5, b"dog" * 11)
    plain, with_cat = block_hashes(ids, 4), block_hashes(ids, 4, images=[cat])
    with_dog = block_hashes(ids, 4, images=[dog])
    assert with_cat[0] == with_dog[0] == plain[0]  # the block before the image is shared
    assert all(c != d for c, d in zip(with_cat[1:], with_dog[1:], strict=True))  # every block after is not
    assert with_cat == block_hashes(ids, 4, images=[ImageSpan(6, 5, b"cat" * 11)])
    assert block_hashes(ids, 4, known=with_cat[:2], images=[cat]) == with_cat
    # The same picture elsewhere in the prompt is another key.
    assert block_hashes(ids, 4, images=[ImageSpan(7, 4, cat.hash)])[1] != with_cat[1]
    # An image keys the blocks it touches only: one ending where a block starts leaves that block's key.
    assert block_extra(b"x", [ImageSpan(4, 4, b"h")], 8, 12) == b"x"
    assert block_extra(b"x", [ImageSpan(4, 5, b"h")], 8, 12) == b"x" + ImageSpan(4, 5, b"h").key()


def test_the_prefix_cache_serves_an_images_blocks_only_to_the_same_image():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    ids = image_prompt()

    def computed(seq_id: int, image: bytes) -> Sequence:
        seq = Sequence(seq_id, f"r{seq_id}", list(ids), len(ids), 4, images=(ImageSpan(6, 5, image),))
        bm.allocate(seq, len(ids), bm.match_prefix(seq))
        seq.num_computed_tokens = len(ids)
        bm.register_full_blocks(seq)
        return seq

    first = computed(0, b"cat")
    cat_again = Sequence(1, "r1", list(ids), len(ids), 4, images=(ImageSpan(6, 5, b"cat"),))
    dog = Sequence(2, "r2", list(ids), len(ids), 4, images=(ImageSpan(6, 5, b"dog"),))
    assert bm.match_prefix(cat_again) == 16  # every matchable block (the last token's is computed)
    assert bm.match_prefix(dog) == 4  # the block before the image only
    # The router's cache index names the blocks as the scheduler stored them.
    add = scheduler_pb2.AddRequest(
        prompt_token_ids=ids, images=[scheduler_pb2.PromptImage(offset=6, length=5, hash=b"cat")]
    )
    assert InFlight(add, 0.0, None).block_hashes(4) == bm._hashes(first, 4)
