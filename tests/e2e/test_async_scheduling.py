"""--async-scheduling through the real processes: the next step is planned and sent while the ranks run
this one, its placeholders filled in by the ranks (broadcast from rank 0 under tensor parallelism). The
greedy tokens must be transformers', under preemption, with stop tokens and max_new_tokens ending
sequences whose next step was already sent; a cancelled request frees its blocks."""

from __future__ import annotations

import time

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.reference import GREEDY, assert_matches_reference, generate, run_concurrently


def test_async_scheduling_on_two_ranks_equals_transformers(tiny_model, reference):
    flags = ("--tp", "2", "--dtype", "float64", "--num-kv-blocks", "16", "--async-scheduling")
    with launch(tiny_model, *flags) as (target, _), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert_matches_reference(stub, reference)
        stats = stub.GetStats(pb.StatsRequest())
        assert stats.num_preemptions_total > 0  # 16 blocks for ten prompts of up to 224 tokens

        # A stop token, and max_new_tokens, end sequences whose next step is already on its way: the
        # tokens stop there, the same as transformers' up to it.
        ids = [list(p) for p in reference][4:8]
        reqs, wants = [], []
        for k, p in enumerate(ids):
            want = reference[tuple(p)]
            if k % 2:  # max_new_tokens ends it
                reqs.append(dict(token_ids=p, max_new_tokens=3 + k, ignore_eos=True, sampling=GREEDY))
                wants.append((want[: 3 + k], pb.FINISH_REASON_LENGTH))
                continue
            # A stop token ends it: the last token up to the fourth whose first occurrence it is.
            at = max(i for i in range(4 + k) if want.index(want[i]) == i)
            reqs.append(
                dict(
                    token_ids=p,
                    max_new_tokens=20,
                    stop_token_ids=[want[at]],
                    ignore_eos=True,
                    sampling=GREEDY,
                )
            )
            wants.append((want[: at + 1], pb.FINISH_REASON_EOS))
        for (tokens, _, reason, _), want in zip(run_concurrently(stub, reqs), wants, strict=True):
            assert (tokens, reason) == want

        # A request cancelled mid-stream: its blocks come back.
        stream = stub.Generate(
            pb.GenerateRequest(token_ids=ids[0], max_new_tokens=200, ignore_eos=True, sampling=GREEDY)
        )
        next(stream)
        stream.cancel()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = stub.GetStats(pb.StatsRequest())
            if stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
                break
            time.sleep(0.1)
        assert stats.kv_blocks_free == stats.kv_blocks_total
        tokens, *_ = generate(stub, token_ids=ids[1], max_new_tokens=6, ignore_eos=True, sampling=GREEDY)
        assert tokens == reference[tuple(ids[1])][:6]
