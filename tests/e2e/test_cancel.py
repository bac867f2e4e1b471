"""A cancelled call gives its resources back at once, wherever the request is: queued in the router,
waiting in the scheduler, in the middle of a chunked prefill, swapped out, or decoding.

"At once" is measured in scheduler iterations, not seconds: after the client cancels, the request's KV
blocks are free before the scheduler has run a handful more steps, while the request itself still had
dozens (or hundreds) to go.
"""

from __future__ import annotations

import threading

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_reliability import wait_until

# The abort crosses two processes while steps go on (the tiny model's take a few ms: CI's loaded run saw
# 10 pass), never the 50 to 100+ each request here still had to go.
STEPS_AFTER_CANCEL = 24


def stats(stub) -> pb.Stats:
    return stub.GetStats(pb.StatsRequest(), timeout=10)


def start(stub, request: pb.GenerateRequest):
    """Starts a stream and reads it on a thread (so it is in flight); returns the call, to cancel."""
    call = stub.Generate(request, timeout=300)

    def drain():
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    return call


def stats_when(stub, predicate, what: str) -> pb.Stats:
    """The first stats for which predicate holds (polled, bounded)."""

    def check():
        s = stats(stub)
        return s if predicate(s) else None

    return wait_until(check, 30, what)


def cancel_and_count_steps(stub, calls, freed) -> int:
    """Cancels the calls; returns how many steps the scheduler ran until freed(stats) held."""
    before = stats(stub).num_steps_total
    for call in calls:
        call.cancel()
    return stats_when(stub, freed, "resources freed").num_steps_total - before


def all_free(s: pb.Stats) -> bool:
    return s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 and s.num_waiting == 0


def router_queue(s: pb.Stats) -> int:
    return sum(b.waiting for b in s.buckets)


def test_cancel_while_queued_in_the_router_or_waiting_in_the_scheduler(tiny_model):
    # 64 blocks of 16 tokens. A blocker of 900 prompt tokens (57 blocks) decoding 110 more holds nearly all
    # of them; the next request (200 tokens, 13 blocks) has credit but no blocks, so it waits in the
    # scheduler; with one request allowed to wait there, a third waits in the router's queue.
    flags = ("--num-kv-blocks", "64", "--admission-window", "1")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        blocker = start(stub, pb.GenerateRequest(token_ids=[5] * 900, max_new_tokens=110, ignore_eos=True))
        stats_when(stub, lambda s: s.num_running == 1, "the blocker running")
        waiting = start(stub, pb.GenerateRequest(token_ids=[6] * 200, max_new_tokens=5))
        queued = start(stub, pb.GenerateRequest(token_ids=[7] * 10, max_new_tokens=5))
        stats_when(stub, lambda s: s.num_waiting == 2 and router_queue(s) == 1, "one in each queue")
        queued.cancel()
        stats_when(stub, lambda s: router_queue(s) == 0 and s.num_waiting == 1, "gone from the router")
        waiting.cancel()
        stats_when(stub, lambda s: s.num_waiting == 0, "gone from the scheduler")
        assert cancel_and_count_steps(stub, [blocker], all_free) <= STEPS_AFTER_CANCEL


def test_cancel_in_the_middle_of_a_chunked_prefill(tiny_model):
    # 16 tokens a step: a 900-token prompt takes ~57 steps of prefill.
    with (
        launch(tiny_model, "--max-num-batched-tokens", "16") as (target, _),
        grpc.insecure_channel(target) as ch,
    ):
        stub = generation_pb2_grpc.GenerationStub(ch)
        call = start(stub, pb.GenerateRequest(token_ids=[7] * 900, max_new_tokens=50, ignore_eos=True))
        wait_until(lambda: stats(stub).num_steps_total >= 5, 30, "prefill under way")
        assert stats(stub).num_running == 1  # still prefilling: it has produced nothing
        assert cancel_and_count_steps(stub, [call], all_free) <= STEPS_AFTER_CANCEL


def test_cancel_while_decoding_and_while_swapped_out(tiny_model):
    # 8 blocks of 16 tokens: two 40-token prompts growing to 120 tokens each cannot both stay; with swap
    # space the newer one is swapped out to host memory while the older decodes.
    flags = ("--num-kv-blocks", "8", "--swap-space", "0.01")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [
            start(stub, pb.GenerateRequest(token_ids=[3 + i] * 40, max_new_tokens=80, ignore_eos=True))
            for i in range(2)
        ]
        wait_until(lambda: stats(stub).num_swapped == 1, 60, "one sequence swapped out")
        # Cancelling both: the swapped one and the one decoding.
        steps = cancel_and_count_steps(stub, calls, lambda s: all_free(s) and s.num_swapped == 0)
        assert steps <= STEPS_AFTER_CANCEL
