"""Cache-aware routing: the router's index of each replica follows the replica's KV events exactly, and
requests go where their prefix is cached unless that replica is overloaded. Plain Python with a fake
clock, and the scheduler's Engine driven by a fake worker group (no processes, no gRPC, no torch)."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.block_hash import block_hashes
from common.kv_events import KvEvents
from common.load import ReplicaLoad
from common.pb.tpserve.internal.v1 import scheduler_pb2
from router.cache_index import HOST, CacheIndex
from router.in_flight import InFlight
from router.replicas import ReplicaSet, RoutingPolicy
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.router_streams import RouterStream
from tests.unit.test_engine import FakeWorkerGroup, add_request

BS = 16


def idle(running=0, waiting=0, max_num_seqs=16):
    return ReplicaLoad(waiting, running, 1000, 1000, max_num_seqs, 0.0, True)


def three(policy=None, **loads):
    rs = ReplicaSet(policy or RoutingPolicy(), ("a", "b", "c"))
    for rid in ("a", "b", "c"):
        rs.report(rid, loads.get(rid, idle()), 0.0)
        rs.kv_events(rid, KvEvents(reset=True))
    return rs


def report_all(rs, now, **loads):
    for rid in ("a", "b", "c"):
        rs.report(rid, loads.get(rid, idle()), now)


PREFIX = list(range(100, 100 + 8 * BS))  # 8 blocks
PROMPT = PREFIX + [7, 8, 9]
HASHES = block_hashes(PROMPT, BS)


def test_a_request_goes_to_the_replica_holding_its_prefix_unless_it_is_overloaded():
    rs = three()
    rs.kv_events("b", KvEvents(stored=tuple(block_hashes(PREFIX, BS))))
    rs.kv_events("c", KvEvents(stored=tuple(block_hashes(PREFIX[: 2 * BS], BS))))  # a shorter prefix
    assert [rs.choose(len(PROMPT), HASHES, now=0.0) for _ in range(3)] == ["b"] * 3
    assert rs.stats(0.0)[1].cache_hit_tokens_total == 3 * 8 * BS
    # b a bit busier than the others: the prefill a full hit saves still wins.
    report_all(rs, 1.0, b=idle(running=4))
    assert rs.choose(len(PROMPT), HASHES, now=1.0) == "b"
    # b overloaded (every slot taken and as many queued): the request goes to c, which holds the next
    # longest prefix, though a is as idle.
    report_all(rs, 2.0, b=idle(running=16, waiting=16))
    assert rs.choose(len(PROMPT), HASHES, now=2.0) == "c"
    # A prompt with no cached prefix anywhere goes by load alone.
    assert rs.choose(50, block_hashes(list(range(50)), BS), now=2.0) == "a"


def test_after_the_replica_evicts_the_prefix_routing_follows_the_events():
    rs = three()
    rs.kv_events("a", KvEvents(stored=tuple(block_hashes(PREFIX, BS))))
    assert rs.choose(len(PROMPT), HASHES, now=0.0) == "a"
    # a evicted the prefix's third block (and with it every longer prefix, for routing); c computed it.
    rs.kv_events("a", KvEvents(removed=(HASHES[2],)))
    rs.kv_events("c", KvEvents(stored=tuple(HASHES[:5])))
    report_all(rs, 1.0)
    assert rs.choose(len(PROMPT), HASHES, now=1.0) == "c"
    rs.kv_events("c", KvEvents(removed=tuple(HASHES[:5])))
    report_all(rs, 2.0)
    assert rs.choose(len(PROMPT), HASHES, now=2.0) == "a"  # two blocks still there


def test_a_replica_restarted_empty_is_routed_as_empty():
    rs = three()
    rs.kv_events("a", KvEvents(stored=tuple(HASHES)))
    rs.kv_events("b", KvEvents(stored=tuple(HASHES[:4])))
    rs.mark_down("a", 0.5)  # its stream broke: the scheduler may come back with nothing
    assert rs.cached_hashes("a") == set()
    # It came back (a new stream begins with a snapshot of its empty cache) and is idlest: the request
    # goes to b, which holds part of the prefix.
    rs.kv_events("a", KvEvents(reset=True))
    report_all(rs, 1.0, b=idle(running=1), c=idle(running=1))
    assert rs.is_up("a", 1.0)
    assert rs.choose(len(PROMPT), HASHES, now=1.0) == "b"
    # Shards lost and back on a scheduler that stayed up: a snapshot (reset) replaces what was held.
    rs.kv_events("b", KvEvents(stored=(b"other",), reset=True))
    assert rs.cached_hashes("b") == {b"other"}


def test_least_loaded_and_round_robin_ignore_the_cache():
    for policy, expected in (("least_loaded", ["a", "b", "c"]), ("round_robin", ["a", "b", "c", "a"])):
        rs = three(RoutingPolicy(routing_policy=policy))
        rs.kv_events("b", KvEvents(stored=tuple(HASHES)))
        got = []
        for t in range(len(expected)):
            got.append(rs.choose(len(PROMPT), HASHES, now=float(t)))
            report_all(rs, float(t), c=idle(running=8) if policy == "round_robin" else idle())
        assert got == expected, policy


def test_the_index_is_bounded_and_counts_what_it_drops():
    index = CacheIndex(capacity=3)
    index.apply(KvEvents(stored=(b"1", b"2", b"3", b"4")))
    assert index.hashes() == {b"2", b"3", b"4"} and index.dropped == 1
    assert index.matched_blocks([b"2", b"3", b"9", b"4"]) == 2


def test_the_index_keeps_each_tier_and_a_host_block_is_worth_less_than_a_device_block():
    index = CacheIndex(capacity=10)
    index.apply(KvEvents(stored=(b"1", b"2"), host_stored=(b"2", b"3", b"4")))
    assert index.match([b"1", b"2", b"3", b"5", b"4"]) == (2, 1)  # 2 is on the device too
    index.apply(KvEvents(removed=(b"2",), host_removed=(b"3",)))
    assert index.match([b"1", b"2", b"3"]) == (1, 1) and index.hashes(HOST) == {b"2", b"4"}
    index.apply(KvEvents(reset=True, host_stored=(b"9",)))
    assert index.hashes() == set() and index.hashes(HOST) == {b"9"} and len(index) == 1
    # Three idle replicas: a holds the prefix on its device, b only in its host tier, c not at all.
    rs = three()
    rs.kv_events("a", KvEvents(stored=tuple(HASHES[:4])))
    rs.kv_events("b", KvEvents(host_stored=tuple(HASHES)))
    assert rs.choose(len(PROMPT), HASHES, now=1.0) == "b"  # 7 host blocks beat 4 device ones (0.8 each)
    rs.kv_events("a", KvEvents(stored=tuple(HASHES)))
    assert rs.choose(len(PROMPT), HASHES, now=1.0) == "a"  # the same prefix: the device wins
    rs.kv_events("a", KvEvents(reset=True))
    assert rs.choose(len(PROMPT), HASHES, now=1.0) == "b"  # a host hit beats nothing


def test_a_request_wanting_prompt_logprobs_has_no_cacheable_prefix():
    add = scheduler_pb2.AddRequest(request_id="r", prompt_token_ids=PROMPT)
    req = InFlight(add, 0.0, None)
    assert req.block_hashes(BS) == block_hashes(PROMPT, BS)  # 131 tokens: 8 blocks, the last one's too
    assert req.block_hashes(BS)[:1] == HASHES[:1]
    add.prompt_token_ids[:] = PREFIX  # 128 tokens: the last block holds the last token, never matched
    assert len(InFlight(add, 0.0, None).block_hashes(BS)) == 7
    add.want_prompt_logprobs = True
    assert InFlight(add, 0.0, None).block_hashes(BS) == []


@pytest.mark.parametrize("host_blocks", [0, 24], ids=["device", "device+host"])
def test_the_routers_index_equals_the_schedulers_cache_after_every_step(host_blocks):
    """A long random run: requests over a few shared prefixes through a small cache (so blocks are
    evicted; with a host tier, offloaded, evicted from it and restored), aborts, ranks lost and back (a
    fresh cache), a second router joining midway. After every step, each router's index (fed only by
    the messages on its stream) is the scheduler's set of hashes, in each tier."""

    def tiers(blocks):
        host = set() if blocks.host_tier is None else set(blocks.host_tier.cached_hashes())
        return set(blocks.cached_hashes()), host

    def indexed(index):
        return index.cached_hashes("x"), index.cached_hashes("x", HOST)

    async def go():
        rng = random.Random(0)
        group = FakeWorkerGroup(num_blocks=40, num_host_blocks=host_blocks)
        group.fail_steps = {120, 260}
        config = SchedulerConfig(
            workers=("fake:0",),
            block_size=4,
            enable_prefix_caching=True,
            worker_recovery_timeout_s=30.0,
            swap_space=1.0 if host_blocks else 0.0,
            host_prefix_cache=bool(host_blocks),
        )
        engine = Engine(config, group)
        routers = {"r1": RouterStream()}
        indexes = {"r1": ReplicaSet(RoutingPolicy(), ["x"])}
        prefixes = [[rng.randrange(2, 90) for _ in range(rng.choice((8, 12, 20)))] for _ in range(4)]
        state = {"steps": 0, "added": 0, "checked": 0}

        def drain():
            for name, stream in routers.items():
                while not stream.outbox.empty():
                    msg = stream.outbox.get_nowait()
                    if msg is not None and msg.HasField("kv_events"):
                        indexes[name].kv_events("x", KvEvents.from_message(msg.kv_events))

        def add_some(n):
            for _ in range(n):
                prompt = rng.choice(prefixes)[: rng.randrange(4, 21)] + [
                    rng.randrange(2, 90) for _ in range(rng.randrange(0, 9))
                ]
                if len(prompt) < 2:
                    prompt += [5, 6]
                rid = f"q{state['added']}"
                state["added"] += 1
                engine.add(add_request(rid, prompt, rng.randrange(1, 8)), routers["r1"])

        publish = engine._publish

        def checked_publish(result):
            publish(result)
            drain()
            cached = tiers(engine.scheduler.blocks)
            for name in routers:
                assert indexed(indexes[name]) == cached, (name, state["steps"])
            state["steps"] += 1
            state["checked"] += 1
            if state["steps"] == 150:  # a second router connects: it starts from a snapshot
                routers["r2"] = RouterStream()
                indexes["r2"] = ReplicaSet(RoutingPolicy(), ["x"])
                engine.attach(routers["r2"])
            ids = engine.routers.request_ids
            if ids and rng.random() < 0.05:
                engine.abort(rng.choice(ids))
            if state["added"] < 400 and rng.random() < 0.5:
                add_some(rng.randrange(1, 4))

        engine._publish = checked_publish
        task = asyncio.create_task(engine.serve_forever())
        try:
            async with asyncio.timeout(60):
                while not engine.ready.is_set():
                    await asyncio.sleep(0.001)
                engine.attach(routers["r1"])
                add_some(4)
                while state["added"] < 400 or engine.routers.request_ids:
                    if task.done():
                        task.result()  # a failed check inside the step loop
                    if not engine.routers.request_ids:
                        add_some(1)  # steps add more as they go; an idle engine has none
                    await asyncio.sleep(0.002)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        drain()
        blocks = engine.scheduler.blocks
        assert indexed(indexes["r1"]) == tiers(blocks)
        assert state["checked"] > 300 and group.connects == 3
        assert blocks.prefix_cache_hits > 0  # the run did reuse (and so evict) blocks
        if host_blocks:  # and the host tier took evicted blocks and gave some back
            assert blocks.host_tier.offloaded_blocks > host_blocks and blocks.host_tier.restored_blocks > 0

    asyncio.run(go())
