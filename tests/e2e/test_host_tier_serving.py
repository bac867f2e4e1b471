"""The prefix cache's host tier through the real processes, against transformers (float64): a prompt
whose blocks other prompts evicted from a small device cache comes back from host memory, with the same
tokens as when it was computed, and without a prefill of those tokens."""

from __future__ import annotations

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_observability import scrape
from tests.e2e.test_swap_serving import BLOCK_BYTES
from tests.reference import GREEDY, MAX_NEW, generate


def test_an_evicted_prefix_is_restored_from_host_memory_and_decodes_like_transformers(tiny_model, reference):
    by_len = {len(ids): list(ids) for ids in reference}
    long, others = by_len[200], (by_len[130], by_len[90])
    # 16 device blocks (256 tokens): the 200-token prompt takes 14, and the two after it evict all of
    # its 13 full blocks, which the host tier (64 blocks of swap space) keeps.
    flags = ("--dtype", "float64", "--num-kv-blocks", "16", "--swap-space", repr(64.5 * BLOCK_BYTES / 2**30))
    flags += ("--enable-prefix-caching", "--host-prefix-cache", "--metrics-port", "0")
    request = dict(max_new_tokens=MAX_NEW, ignore_eos=True, sampling=GREEDY)
    with launch(tiny_model, *flags) as (target, info), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        port = info["metrics_ports"]["scheduler"]
        computed, _, _, last = generate(stub, token_ids=long, **request)
        assert computed == reference[tuple(long)] and last.usage.cached_tokens == 0
        for ids in others:
            assert generate(stub, token_ids=ids, **request)[0] == reference[tuple(ids)]
        before, stats = scrape(port), stub.GetStats(pb.StatsRequest())
        assert before["tpserve_kv_offloaded_blocks_total"] >= 13
        assert before["tpserve_host_prefix_cache_hits_total"] == 0

        restored, _, _, last = generate(stub, token_ids=long, **request)
        after, stats_after = scrape(port), stub.GetStats(pb.StatsRequest())
        # The tokens of recomputing it, and transformers'.
        assert restored == computed == reference[tuple(long)]
        # Its 12 matchable blocks (never the last token's) came back from host memory: 192 tokens not
        # computed; the steps computed the 8 others, then one token for each of the 23 decodes after
        # the first.
        assert last.usage.cached_tokens == 192
        assert after["tpserve_kv_restored_blocks_total"] - before["tpserve_kv_restored_blocks_total"] == 12
        assert after["tpserve_host_prefix_cache_hits_total"] == 192
        assert after["tpserve_prefix_cache_hits_total"] == before["tpserve_prefix_cache_hits_total"]
        assert stats_after.batched_tokens_total - stats.batched_tokens_total == (200 - 192) + MAX_NEW - 1
        assert after["tpserve_host_prefix_cache_blocks"] >= 13
