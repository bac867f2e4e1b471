"""What imports what: pure policy stays free of gRPC and torch, and servers never load the benchmark."""

import subprocess
import sys

from tests.conftest import ROOT

PURE = [
    "scheduler.scheduler",
    "scheduler.policy",
    "scheduler.forks",
    "scheduler.block_manager",
    "scheduler.batch",
    "scheduler.plan",
    "scheduler.capacity",
    "scheduler.swap",
    "scheduler.fallback",
    "router.buckets",
    "router.replicas",
    "router.stop_strings",
    "common.settings",
    "shard_worker.devices",
]


def loaded_after(imports: list[str]) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in imports) + "print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_pure_policy_imports_neither_grpc_nor_torch():
    loaded = loaded_after(PURE)
    assert not {"grpc", "torch"} & loaded


def test_the_cli_and_the_servers_do_not_load_the_benchmark_client():
    loaded = loaded_after(["common.cli", "router.server", "scheduler.server"])
    assert not {"bench.client_run", "bench.report", "matplotlib", "tqdm"} & loaded
