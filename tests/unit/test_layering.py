"""What imports what: pure policy stays free of gRPC and torch, and servers never load the benchmark."""

import json
import subprocess
import sys

from tests.conftest import ROOT

PURE = [
    "scheduler.scheduler",
    "scheduler.admission",
    "scheduler.preemption",
    "scheduler.policy",
    "scheduler.forks",
    "scheduler.block_manager",
    "scheduler.batch",
    "scheduler.plan",
    "scheduler.capacity",
    "scheduler.swap",
    "scheduler.fallback",
    "scheduler.lora_slots",
    "scheduler.batch_wait",
    "scheduler.add_request",
    "router.buckets",
    "router.replicas",
    "common.load",
    "common.block_hash",
    "common.kv_events",
    "router.cache_index",
    "router.stop_strings",
    "common.settings",
    "shard_worker.devices",
    "shard_worker.mrope",
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


# Each process's command run as `tpserve` runs it, up to the moment it would serve (its serve() is
# replaced by one that records what is loaded; the router's first loads the tokenizer, as it does).
_STARTED = """
import asyncio, importlib, json, sys

command, argv = sys.argv[1], sys.argv[2:]
module = importlib.import_module(command.replace("-", "_") + ".server")
real_serve, seen = module.serve, {}

def record(config):
    if command == "router":
        from router.tokenizer import Tokenizer
        Tokenizer.from_pretrained(config.model).close()
    seen["modules"] = sorted(sys.modules)

async def record_async(config):
    record(config)

module.serve = record_async if asyncio.iscoroutinefunction(real_serve) else record
from common import cli
assert cli.main([command, *argv]) == 0
print(json.dumps(seen["modules"]))
"""


def started(command: str, *argv: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _STARTED, command, *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


def packages(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_each_process_imports_only_itself_and_common(tiny_model):
    """common/ is the leaf: `tpserve shard-worker` loads no router or scheduler code, `tpserve scheduler`
    no router, worker or torch, `tpserve router` (its tokenizer loaded) no scheduler, worker or torch."""
    ours = {"router", "scheduler", "shard_worker", "bench"}
    worker = started("shard-worker", "--model", str(tiny_model), "--port", "0")
    assert packages(worker) & ours == {"shard_worker"}
    scheduler = started("scheduler", "--worker", "127.0.0.1:1", "--port", "0")
    assert packages(scheduler) & ours == {"scheduler"} and "torch" not in scheduler
    router = started("router", "--model", str(tiny_model), "--scheduler", "127.0.0.1:1", "--port", "0")
    assert packages(router) & ours == {"router"}
    assert "torch" not in router and "transformers" in packages(router)
