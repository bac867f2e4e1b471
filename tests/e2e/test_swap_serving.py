"""Swap preemption through the real processes, against transformers: a KV pool far too small for the
load, with swap space for every preempted sequence, and with too little for some (swap and recompute)."""

from __future__ import annotations

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_observability import scrape
from tests.reference import assert_matches_reference

# The tiny model in float64: 2 layers x 16 tokens x (K and V) x 2 heads x 16 dims x 8 bytes.
BLOCK_BYTES = 2 * 16 * 2 * 2 * 16 * 8
KINDS = ("swap", "recompute")
# In a few percent of passes nothing is preempted; with 3 host blocks, about a third of passes see both
# kinds. Enough passes that the test fails only when the feature does.
MAX_PASSES = 30


def serve_with_swap(tiny_model, reference, host_blocks: int, until) -> dict[str, float]:
    """Runs the reference prompts on 16 device blocks and host_blocks of swap space, again (a pass takes
    a fraction of a second) until the scheduler's preemption counters by kind satisfy `until`: which
    sequences get preempted depends on when the concurrent requests arrive. Returns the counters."""
    swap_gib = (host_blocks + 0.5) * BLOCK_BYTES / 2**30
    flags = ("--dtype", "float64", "--num-kv-blocks", "16", "--swap-space", repr(swap_gib))
    flags += ("--metrics-port", "0")
    with launch(tiny_model, *flags) as (target, info), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for _ in range(MAX_PASSES):
            assert_matches_reference(stub, reference)
            stats = stub.GetStats(pb.StatsRequest())
            assert stats.kv_blocks_free == stats.kv_blocks_total == 16
            assert stats.num_swapped == 0 and stats.num_running == stats.num_waiting == 0
            metrics = scrape(info["metrics_ports"]["scheduler"])
            assert metrics["tpserve_num_requests_swapped"] == 0
            kinds = {k: metrics.get(f"tpserve_preemptions_total{{kind={k}}}", 0.0) for k in KINDS}
            assert sum(kinds.values()) == stats.num_preemptions_total
            if until(kinds):
                return kinds
    raise AssertionError(f"after {MAX_PASSES} passes, preemptions by kind: {kinds}")


def test_outputs_equal_transformers_with_swap_preemption(tiny_model, reference):
    # 64 host blocks hold everything the 16 device blocks can: every preemption swaps.
    kinds = serve_with_swap(tiny_model, reference, 64, until=lambda k: k["swap"] > 0)
    assert kinds["recompute"] == 0


def test_outputs_equal_transformers_with_swap_space_too_small_for_all(tiny_model, reference):
    # 3 host blocks: a short sequence swaps; a longer one, or one preempted while the space is taken,
    # is recomputed.
    serve_with_swap(tiny_model, reference, 3, until=lambda k: k["swap"] > 0 and k["recompute"] > 0)
