"""The scheduler's link to the shard workers of its replica: describe, agree capacity, allocate the caches,
then one step stream per rank.

A step is serialized once and written to every rank at the same time; the replies are awaited together.
Any failure of a rank (an RPC error, a stream that ended, no answer within step_timeout_s) is a
WorkersLost: the group's caches are useless from then on and the engine rebuilds everything.

A rank lost while the engine is idle is noticed too: each step stream's completion is watched, and a
stream that ends without the scheduler closing it wakes the engine (`connect`'s on_lost), whose next
`check()` raises WorkersLost. So health turns NOT_SERVING at once, whether or not a step was running.

The engine needs only connect / check / step (or send and receive) / close: unit tests drive it with a
fake group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass

import grpc

from common import kv_cache_spec, security
from common.grpc_util import OPTIONS, SCHEDULER_EPOCH_KEY, SCHEDULER_METADATA_KEY
from common.pb.tpserve.internal.v1 import worker_pb2, worker_pb2_grpc
from scheduler.capacity import Capacity, RankCapacity, settle
from scheduler.config import SchedulerConfig
from scheduler.lora_admin import check_lora_settings

log = logging.getLogger("tpserve.scheduler")

STEP_METHOD = "/tpserve.internal.v1.ShardWorker/Step"


class WorkersLost(Exception):
    """A rank failed, went silent or ended its stream: the group must be connected again."""


@dataclass(frozen=True)
class WorkerGroupInfo:
    """What the ranks said about themselves, and the capacity settled for them."""

    describe: tuple[worker_pb2.DescribeResponse, ...]  # in rank order
    capacity: Capacity


class WorkerGroup:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._channels: list[grpc.aio.Channel] = []
        self._streams: list = []
        self._broken: str | None = None  # why a step stream ended on its own
        # Who this scheduler is, to its workers (shard_worker/lease.py): a name, where it serves once
        # serve() knows its port (name_as), and an epoch: this process's start, so that a restart of
        # the same scheduler takes its workers over at once while another must wait for their lease.
        self.epoch = time.time_ns()
        self.name_as(f"{socket.gethostname()} pid {os.getpid()}")

    def name_as(self, name: str) -> None:
        self.name = name
        self._metadata = ((SCHEDULER_METADATA_KEY, name), (SCHEDULER_EPOCH_KEY, str(self.epoch)))

    async def connect(self, on_lost=lambda: None) -> WorkerGroupInfo:
        """Describes every rank, settles the capacity, allocates the caches and opens the step streams.
        Raises WorkersLost when a rank cannot be reached, and CapacityError when the ranks cannot serve
        together. on_lost() is called when a step stream ends that this group did not close."""
        await self.close()
        cfg, policy = self.config, self.config.policy
        self._channels = [security.aio_channel(addr, cfg.internal_tls, OPTIONS) for addr in cfg.workers]
        stubs = [worker_pb2_grpc.ShardWorkerStub(ch) for ch in self._channels]
        describe = worker_pb2.DescribeRequest(
            block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kv_cache_gib=cfg.cpu_kv_cache_gib,
            max_num_batched_tokens=policy.max_num_batched_tokens,
            max_num_seqs=policy.max_num_seqs,
            max_model_len=policy.max_model_len,
        )
        try:
            infos = await asyncio.gather(
                *(
                    s.Describe(
                        describe,
                        wait_for_ready=True,
                        timeout=cfg.worker_connect_timeout_s,
                        metadata=self._metadata,
                    )
                    for s in stubs
                )
            )
            for rank, info in enumerate(infos):
                if info.rank != rank or info.world_size != len(infos):
                    raise RuntimeError(
                        f"worker {cfg.workers[rank]} says it is rank {info.rank} of {info.world_size}, "
                        f"expected rank {rank} of {len(infos)}"
                    )
            check_lora_settings(cfg.enable_lora, cfg.lora_modules, policy.max_loras, infos)
            layout = kv_cache_spec.from_describe(
                infos[0].layer_windows, cfg.block_size, infos[0].layer_latent_dims
            )
            capacity = settle(
                [
                    RankCapacity(
                        i.rank,
                        i.num_kv_blocks,
                        i.kv_block_bytes,
                        i.max_position_embeddings,
                        i.state_slot_bytes,
                        i.num_state_slots,
                    )
                    for i in infos
                ],
                block_size=cfg.block_size,
                max_num_seqs=policy.max_num_seqs,
                max_model_len=policy.max_model_len,
                swap_space_gib=cfg.swap_space,
                layout=layout,
            )
            if layout is not None:
                log.info("KV cache: %s", kv_cache_spec.summary(layout))
            log.info(
                "KV capacity per rank: %s blocks; the pool: %d blocks of %d tokens",
                [i.num_kv_blocks for i in infos],
                capacity.num_blocks,
                cfg.block_size,
            )
            if capacity.state is not None:
                log.info(
                    "KV cache: a recurrent-state slot per sequence (linear-attention layers), %d slots "
                    "of %.2f MiB, %d in host swap space; no prefix caching (the state after a prefix is "
                    "not kept: every prompt is computed whole)",
                    capacity.state.num_slots,
                    capacity.state.slot_bytes / 2**20,
                    capacity.state.num_host_slots,
                )
            for note in capacity.notes:
                log.warning("%s", note)
            init = worker_pb2.InitCacheRequest(
                num_blocks=capacity.num_blocks,
                block_size=cfg.block_size,
                num_host_blocks=capacity.num_host_blocks,
                max_model_len=capacity.max_model_len,
                max_num_seqs=policy.max_num_seqs,
                num_state_slots=capacity.state.num_slots if capacity.state else 0,
                num_host_state_slots=capacity.state.num_host_slots if capacity.state else 0,
            )
            await asyncio.gather(*(s.InitCache(init, metadata=self._metadata) for s in stubs))
        except (grpc.RpcError, TimeoutError) as e:
            raise WorkersLost(_detail(e)) from e
        # Steps are serialized once by the engine: the stream takes bytes as they are.
        self._streams = [
            ch.stream_stream(STEP_METHOD, response_deserializer=worker_pb2.StepResponse.FromString)(
                metadata=self._metadata
            )
            for ch in self._channels
        ]
        self._broken = None
        for rank, stream in enumerate(self._streams):
            stream.add_done_callback(self._watcher(rank, stream, on_lost))
        return WorkerGroupInfo(tuple(infos), capacity)

    def _watcher(self, rank: int, stream, on_lost):
        def ended(_call) -> None:
            if any(s is stream for s in self._streams):  # not one this group closed
                self._broken = f"rank {rank}'s step stream ended"
                on_lost()

        return ended

    def check(self) -> None:
        """Raises WorkersLost if a rank's stream has ended since connect()."""
        if self._broken is not None:
            raise WorkersLost(self._broken)

    async def step(self, request: bytes, step_id: int) -> list[worker_pb2.StepResponse]:
        """Sends one serialized StepRequest to every rank at once and returns their replies, in rank
        order, once all have answered."""
        await self.send(request)
        return await self.receive(step_id)

    async def send(self, request: bytes) -> None:
        """Writes a serialized StepRequest to every rank's stream. A write hands the bytes to the rank's
        transport and returns: every rank has the step before any forward is awaited. With async
        scheduling the next step is sent before this one's replies are read: each rank reads it once
        it has answered this one."""
        try:
            async with asyncio.timeout(self.config.step_timeout_s):
                for stream in self._streams:
                    await stream.write(request)
        # A stream that already ended raises InvalidStateError on write (a rank died while idle).
        except (grpc.RpcError, TimeoutError, asyncio.InvalidStateError) as e:
            raise WorkersLost(_detail(e)) from e

    async def receive(self, step_id: int) -> list[worker_pb2.StepResponse]:
        """Every rank's reply to step step_id (the oldest step sent and not yet received), in rank order."""
        try:
            async with asyncio.timeout(self.config.step_timeout_s):
                # Tasks (gather) only where there is more than one reply to wait for: each costs
                # event-loop turns on every step.
                if len(self._streams) == 1:
                    replies = [await self._streams[0].read()]
                else:
                    replies = await asyncio.gather(*(stream.read() for stream in self._streams))
        except (grpc.RpcError, TimeoutError, asyncio.InvalidStateError) as e:
            raise WorkersLost(_detail(e)) from e
        for rank, r in enumerate(replies):
            if r is grpc.aio.EOF or r.step_id != step_id:
                raise WorkersLost(f"rank {rank}'s step stream ended")
        return replies

    async def on_every_rank(self, method: str, request) -> list:
        """Calls a unary ShardWorker method (LoadLoRAAdapter, ...) on every rank at once, beside the step
        stream: each rank's answer, or the exception it raised, in rank order ([] when not connected)."""
        stubs = [worker_pb2_grpc.ShardWorkerStub(ch) for ch in self._channels]
        calls = (
            getattr(s, method)(request, timeout=self.config.step_timeout_s, metadata=self._metadata)
            for s in stubs
        )
        return await asyncio.gather(*calls, return_exceptions=True)

    async def close(self) -> None:
        streams, channels = self._streams, self._channels
        self._streams, self._channels = [], []  # first, so the watchers know these ends are ours
        for stream in streams:
            stream.cancel()
        for ch in channels:
            await ch.close()


def _detail(e: Exception) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, TimeoutError):
        return "no answer in time"
    return f"{type(e).__name__}: {e}"
