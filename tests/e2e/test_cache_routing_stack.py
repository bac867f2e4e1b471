"""Cache-aware routing through the real processes: three replicas of the tiny model behind one router,
each scheduler reporting its prefix cache's KV events. What a user would notice: a conversation's
repeated prefix is served by the replica that already holds it (its tokens come from that cache),
where load alone would spread the requests over the three."""

from __future__ import annotations

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_reliability import wait_until
from tests.reference import GREEDY, generate

BLOCK = 16
# A small cache: no memory profile, and three ranks do not each fill 2 GiB.
FLAGS = ("--replicas", "3", "--enable-prefix-caching", "--num-kv-blocks", "64")


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(tiny_model):
    with launch(tiny_model, *FLAGS) as (target, info):
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            def replicas():
                return {r.replica: r for r in stub.GetStats(pb.StatsRequest()).replicas}

            wait_until(lambda: len(replicas()) == 3 and all(r.up for r in replicas().values()), 60, "3 up")
            prefix = [3 + (i * 37) % 1000 for i in range(10 * BLOCK)]  # 10 blocks, say a system prompt

            def ask(suffix):
                kw = dict(token_ids=prefix + suffix, max_new_tokens=2, ignore_eos=True, sampling=GREEDY)
                return generate(stub, **kw)[3]

            before = replicas()
            first = ask([5])
            assert first.usage.cached_tokens == 0
            after = replicas()
            (holder,) = [r for r in after if after[r].routed_total > before[r].routed_total]
            # Its scheduler's events reach the router: the index holds the prompt's ten full blocks.
            wait_until(lambda: replicas()[holder].cached_blocks >= 10, 10, "the holder's KV events")
            assert all(replicas()[r].cached_blocks == 0 for r in after if r != holder)
            # Every replica is idle again: load alone would go round-robin over the three.
            for k in range(4):
                last = ask([10 + k, 11])
                assert last.usage.cached_tokens == 10 * BLOCK  # served from that replica's cache
            end = replicas()
            routed = {r: end[r].routed_total - after[r].routed_total for r in end}
            assert routed == {r: 4 if r == holder else 0 for r in end}, routed
            hits = end[holder].cache_hit_tokens_total - after[holder].cache_hit_tokens_total
            assert hits == 4 * 10 * BLOCK
            # A prompt cached nowhere is routed by load: not necessarily to the holder.
            others = {
                generate(stub, token_ids=[7 + k] * 40, max_new_tokens=1)[3].usage.cached_tokens
                for k in range(3)
            }
            assert others == {0}
