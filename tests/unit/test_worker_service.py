"""The shard worker's servicer on a real gRPC server over a fake model runner (no model, no forward): one
scheduler drives it (shard_worker/lease.py, also as plain logic), and the LoRA settings its Describe
reports, which a scheduler whose own differ refuses at start."""

from __future__ import annotations

import asyncio
import types
from concurrent import futures

import grpc
import pytest
import torch

from common.grpc_util import SCHEDULER_EPOCH_KEY, SCHEDULER_METADATA_KEY
from common.pb.tpserve.internal.v1 import worker_pb2, worker_pb2_grpc
from shard_worker.config import WorkerConfig
from shard_worker.lease import Caller, Lease, LeaseRefused
from shard_worker.metrics import WorkerMetrics
from shard_worker.server import ShardWorkerServicer

A, B = Caller("host-a:7000", 1), Caller("host-b:7000", 1)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_refuses_another_scheduler_until_it_lapses_and_never_while_stepping():
    clock = Clock()
    lease = Lease(idle_s=10.0, clock=clock)
    lease.take(A, "describe")
    clock.now += 9.0
    with pytest.raises(LeaseRefused, match=r"host-a:7000 .* holds it for 1s more; scheduler host-b"):
        lease.take(B, "describe")
    lease.take(A, "allocate the cache of")  # the holder's calls renew it
    clock.now += 9.0
    lease.renew(A)  # at the end of a long call
    clock.now += 9.0
    with pytest.raises(LeaseRefused):
        lease.take(B, "describe")
    lease.start_stepping(A)
    clock.now += 1000.0
    with pytest.raises(LeaseRefused, match="is stepping it"):
        lease.take(B, "describe")
    lease.stop_stepping(A)
    clock.now += 9.9
    with pytest.raises(LeaseRefused):
        lease.take(B, "describe")
    clock.now += 0.2
    lease.take(B, "describe")  # lapsed: B holds it, A is refused
    assert lease.holds(B)
    with pytest.raises(LeaseRefused):
        lease.start_stepping(A)


def test_a_restarted_scheduler_takes_its_workers_over_at_once_and_its_old_process_is_refused():
    lease = Lease(idle_s=10.0, clock=Clock())
    lease.start_stepping(A)
    restarted = Caller(A.name, A.epoch + 1)
    lease.take(restarted, "describe")  # same name, later epoch: no wait
    assert lease.holds(restarted) and not lease.stepping
    with pytest.raises(LeaseRefused):
        lease.take(A, "describe")
    lease.stop_stepping(A)  # the old stream's end changes nothing of the new holder's
    assert lease.holds(restarted)


class FakeRunner:
    """What the servicer asks of a ModelRunner for Describe, InitCache and a step of no sequences."""

    device = torch.device("meta")  # not "cpu": the servicer would size this process's torch threads
    dtype = kv_dtype = torch.float32
    kernel_warm_up = graphs = lora = sampler = None
    num_state_slots = 0

    def __init__(self):
        self.allocations: list[int] = []
        # One layer, one cache: a fixed block count is that many blocks; share_kv_tensors the servicer sets.
        self.model = types.SimpleNamespace(
            config=types.SimpleNamespace(num_layers=1),
            num_kv_caches=1,
            num_kv_layers=1,
            share_kv_tensors=False,
            kv_layout=None,
        )

    def describe(self):
        return dict(
            model_name="fake", vocab_size=10, max_position_embeddings=64, eos_token_ids=[1],
            weight_bytes=0, draft_model_name="", layer_windows=[0], layer_latent_dims=[0], runner="generate",
            embedding_size=0, cross_encoder=False, state_slot_bytes=0,
        )  # fmt: skip

    def warm_up(self, block_size):
        pass

    def run_synthetic(self, lens, block_size):  # timed by Describe's measure_speed
        return 0.001

    def kv_block_bytes(self, block_size):
        return 1

    def allocate_kv_cache(self, num_blocks, block_size):
        self.allocations.append(num_blocks)
        return num_blocks

    def allocate_host_kv_cache(self, num_blocks, block_size):
        return 0

    def allocate_state_cache(self, num_slots, num_host_slots):
        return 0

    def capture_cuda_graphs(self, max_num_seqs, max_model_len):
        pass


@pytest.fixture
def worker(request):
    runner = FakeRunner()
    config = WorkerConfig(model="fake", **getattr(request, "param", {}))
    servicer = ShardWorkerServicer(runner, config, WorkerMetrics(runner.device, 0))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_ShardWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        servicer.address = f"127.0.0.1:{port}"
        yield worker_pb2_grpc.ShardWorkerStub(channel), runner, servicer
    server.stop(None)


def metadata(caller: Caller):
    return ((SCHEDULER_METADATA_KEY, caller.name), (SCHEDULER_EPOCH_KEY, str(caller.epoch)))


DESCRIBE = worker_pb2.DescribeRequest(block_size=16, num_kv_blocks=8)
INIT = worker_pb2.InitCacheRequest(num_blocks=8, block_size=16, max_model_len=64)


def test_a_second_schedulers_describe_during_anothers_start_is_refused(worker):
    """Before, the worker refused another scheduler only once a Step stream was open: a second
    scheduler's Describe or InitCache between the first's InitCache and its Step resized or emptied the
    cache the first was about to step."""
    stub, runner, _ = worker
    stub.Describe(DESCRIBE, metadata=metadata(A), timeout=10)
    stub.InitCache(INIT, metadata=metadata(A), timeout=10)
    for call, request in (("Describe", DESCRIBE), ("InitCache", INIT)):
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, call)(request, metadata=metadata(B), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "host-a:7000" in e.value.details() and "host-b:7000" in e.value.details()
    assert runner.allocations == [8]  # only A's cache
    # A steps as it meant to; B is still refused while it does, and may not step beside it.
    steps = iter([worker_pb2.StepRequest(step_id=1)])
    [reply] = list(stub.Step(steps, metadata=metadata(A), timeout=10))
    assert reply.step_id == 1
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Step(iter([worker_pb2.StepRequest(step_id=1)]), metadata=metadata(B), timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_restarted_scheduler_is_let_in_at_once(worker):
    stub, runner, servicer = worker
    stub.Describe(DESCRIBE, metadata=metadata(A), timeout=10)
    restarted = Caller(A.name, A.epoch + 1)
    stub.Describe(DESCRIBE, metadata=metadata(restarted), timeout=10)
    stub.InitCache(INIT, metadata=metadata(restarted), timeout=10)
    with pytest.raises(grpc.RpcError) as e:  # the old process, if it is still about
        stub.InitCache(INIT, metadata=metadata(A), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert servicer.lease.holds(restarted) and runner.allocations == [8]


WORKER_LORA = dict(enable_lora=True, max_loras=2, lora_modules=("sql=/adapters/sql",))


@pytest.mark.parametrize("worker", [WORKER_LORA], indirect=True)
def test_a_scheduler_whose_lora_settings_differ_is_refused_before_any_cache_is_allocated(worker):
    """Before, --max-loras was the scheduler's and the worker's separately: with more on the scheduler,
    DeviceSlots.assign raised in the step, which ended the rank, again on every restart."""
    from scheduler.capacity import UnfitRanks
    from scheduler.config import SchedulerConfig
    from scheduler.policy import SchedulingPolicy
    from scheduler.workers import WorkerGroup

    _, runner, servicer = worker

    async def connect(max_loras: int):
        config = SchedulerConfig(
            workers=(servicer.address,),
            enable_lora=True,
            lora_modules=("sql=/elsewhere/sql",),
            num_kv_blocks=8,
            policy=SchedulingPolicy(max_loras=max_loras, max_model_len=64),
        )
        group = WorkerGroup(config)
        try:
            return await group.connect()
        finally:
            await group.close()

    with pytest.raises(UnfitRanks) as e:
        asyncio.run(connect(4))
    assert "--max-loras 4" in str(e.value) and "\n" not in str(e.value)
    assert runner.allocations == []
    info = asyncio.run(connect(2))  # the same settings: served
    assert info.describe[0].max_loras == 2 and runner.allocations == [8]
