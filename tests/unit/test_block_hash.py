"""The one block hash (common/block_hash.py): the router and the scheduler name a prefix alike, in any
process, and the scheduler's prefix cache reports what it stores and evicts (common/kv_events.py)."""

import os
import subprocess
import sys

from common.block_hash import ROOT, block_hashes, hash_block, matchable_blocks
from common.kv_events import KvEventLog, KvEvents
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
