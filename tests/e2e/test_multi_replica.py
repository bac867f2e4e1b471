"""Several model replicas behind one router, through the real processes; and DNS discovery.

What a user would notice: work spread over every replica with the outputs one replica gives, and a
replica dying mid-load without losing a request that had not started streaming.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_reliability import serving, wait_until
from tests.reference import GREEDY, MAX_NEW, generate, run_concurrently


def both_up(stub) -> bool:
    replicas = stub.GetStats(pb.StatsRequest()).replicas
    return len(replicas) == 2 and all(r.up and r.stats_answered for r in replicas)


def test_two_replicas_spread_32_requests_and_give_one_replicas_outputs(tiny_model, reference):
    with launch(tiny_model, "--replicas", "2", "--dtype", "float64") as (target, info):
        assert {"scheduler", "scheduler 1", "shard-worker rank 0", "shard-worker 1 rank 0"} <= set(
            info["pids"]
        )
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            # The router serves once one replica is up; the spread needs both (CI's loaded run sent all
            # 32 to the first while the second's first load report had not come).
            wait_until(lambda: both_up(stub), 120, "both replicas up at the router")
            prompts = [list(ids) for ids in reference]
            reqs = [
                dict(
                    token_ids=prompts[i % len(prompts)],
                    max_new_tokens=MAX_NEW,
                    ignore_eos=True,
                    sampling=GREEDY,
                )
                for i in range(32)
            ]
            results = run_concurrently(stub, reqs)
            for kw, (tokens, _, reason, _) in zip(reqs, results, strict=True):
                assert tokens == reference[tuple(kw["token_ids"])], f"prompt of {len(kw['token_ids'])} tokens"
                assert reason == pb.FINISH_REASON_LENGTH
            stats = stub.GetStats(pb.StatsRequest())
            by_addr = {r.replica: r for r in stats.replicas}
            assert set(by_addr) == {r["scheduler"] for r in info["replicas"]}
            for r in by_addr.values():
                # Both replicas did real work, and are idle again with every block back.
                assert r.up and r.stats_answered and r.routed_total >= 4 and r.num_steps_total > 0, r
                assert r.kv_blocks_free == r.kv_blocks_total > 0 and r.num_running == 0
            assert sum(r.routed_total for r in by_addr.values()) == 32
            # The totals are the sums over the replicas.
            assert stats.num_steps_total == sum(r.num_steps_total for r in by_addr.values())
            assert stats.kv_blocks_total == sum(r.kv_blocks_total for r in by_addr.values())


def test_a_replica_killed_for_good_loses_no_request(tiny_model):
    # Long prompts prefilled 32 tokens a step and short outputs: most of a request's life on a replica is
    # its prefill, so when the replica dies some of its requests have not streamed a token (they move)
    # and some have (they resume on the other replica where they stopped). Restarts are off: it stays
    # dead.
    flags = ("--replicas", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "32")
    out_len = 8
    with launch(tiny_model, *flags) as (target, info):
        victim = info["replicas"][1]["scheduler"]
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            def victim_stats():
                return next(r for r in stub.GetStats(pb.StatsRequest()).replicas if r.replica == victim)

            results: dict[int, tuple[int, grpc.StatusCode | None]] = {}

            def one(i):
                n = 0
                try:
                    req = pb.GenerateRequest(token_ids=[2 + i] * 400, max_new_tokens=out_len, ignore_eos=True)
                    for resp in stub.Generate(req, timeout=120):
                        n += len(resp.token_ids)
                    results[i] = (n, None)
                except grpc.RpcError as e:
                    results[i] = (n, e.code())

            threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
            for t in threads:
                t.start()
            # Some running (they may have streamed) and some admitted there but not started (they have not).
            wait_until(
                lambda: (lambda r: r.num_running > 0 and r.num_waiting > 0)(victim_stats()),
                30,
                "the victim replica running some requests with others waiting",
            )
            os.kill(info["pids"]["scheduler 1"], signal.SIGKILL)
            for t in threads:
                t.join(120)
            assert len(results) == 32
            # Every request completes with all its tokens, each once: none fails.
            assert all(code is None and n == out_len for n, code in results.values()), results
            # The router marked it down, stays SERVING, and new requests avoid it.
            down = wait_until(lambda: not victim_stats().up, 5, "the victim marked down")
            assert down
            assert serving(target)
            for i in range(4):
                assert len(generate(stub, text=f"after {i}", max_new_tokens=3, ignore_eos=True)[0]) == 3
            assert info["launcher"].poll() is None  # the launch goes on with one replica
            # The kill did catch requests on the victim: they moved (resumed or resent), none failed.
            moved = re.search(
                r"lost \(.*\): (\d+) request\(s\) resumed, (\d+) resent, (\d+) failed",
                info["log"].read_text(),
            )
            assert moved and int(moved.group(1)) + int(moved.group(2)) >= 1 and moved.group(3) == "0", moved


def test_router_found_through_scheduler_dns_serves(tiny_model):
    """`tpserve router --scheduler-dns localhost:PORT` in front of a running scheduler."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    with launch(tiny_model) as (_, info):
        port = info["scheduler"].rpartition(":")[2]
        port_file = ROOT / f".router-dns-{os.getpid()}.port"
        cmd = [
            sys.executable,
            "-m",
            "common.cli",
            "--log-level",
            "WARNING",
            "router",
            "--model",
            str(tiny_model),
        ]
        cmd += ["--scheduler-dns", f"localhost:{port}", "--port", "0", "--port-file", str(port_file)]
        proc = subprocess.Popen(cmd, cwd=ROOT)
        try:
            from common.grpc_util import read_port_file

            target = f"127.0.0.1:{read_port_file(port_file, 60, lambda: proc.poll() is None)['port']}"
            wait_until(lambda: serving(target), 30, "the DNS-discovered router SERVING")
            with grpc.insecure_channel(target) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                assert len(generate(stub, text="via dns", max_new_tokens=4, ignore_eos=True)[0]) == 4
                stats = stub.GetStats(pb.StatsRequest())
                assert any(r.up and r.replica.endswith(f":{port}") for r in stats.replicas)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            port_file.unlink(missing_ok=True)
