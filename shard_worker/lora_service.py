"""The shard worker's LoRA calls (part of its servicer, shard_worker/servicer.py): load, unload and prefetch
an adapter beside the step stream, and the LoRA settings Describe reports.

Files are read off the device lock (only placing what was read waits for the step in progress), so a
step never waits on a disk. An adapter whose files do not read is NOT_FOUND naming it: the scheduler
fails the requests on it, never the rank.
"""

from __future__ import annotations

import logging

import grpc

from common.pb.tpserve.internal.v1 import worker_pb2
from common.pb.tpserve.v1 import generation_pb2
from shard_worker.config import WorkerConfig
from shard_worker.model.lora.adapters import AdapterUnreadable

log = logging.getLogger("tpserve.shard_worker")


def lora_settings(config: WorkerConfig) -> dict:
    """DescribeResponse's LoRA fields: the settings the scheduler must share (worker.proto)."""
    if not config.enable_lora:
        return {}
    return dict(
        enable_lora=True,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras or config.max_loras,
        lora_modules=list(config.lora_modules),
    )


class LoRAService:
    """ShardWorkerServicer's LoRA methods: they use its runner, device lock and lease."""

    def _lora(self, context):
        if self.runner.lora is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the worker was started without --enable-lora")
        return self.runner.lora

    def LoadLoRAAdapter(self, request, context):
        lora, name, path = self._lora(context), request.lora_name, request.lora_path
        try:
            weights = lora.read(name, path)  # off the step's lock: reads files and shapes only
        except AdapterUnreadable as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._device_lock:  # between two steps
            self._take_lease(context, "load an adapter on")
            lora.install(name, path, weights)
        log.info("rank %d: LoRA adapter %r loaded from %s", self.config.rank, name, path)
        return generation_pb2.LoadLoRAAdapterResponse()

    def UnloadLoRAAdapter(self, request, context):
        if self.runner.lora is not None:
            with self._device_lock:
                self._take_lease(context, "unload an adapter from")
                if self.runner.lora.remove(request.lora_name):
                    log.info("rank %d: LoRA adapter %r unloaded", self.config.rank, request.lora_name)
        return generation_pb2.UnloadLoRAAdapterResponse()

    def PrefetchLoRAAdapter(self, request, context):
        lora, name = self._lora(context), request.lora_name
        try:
            fetched = lora.fetch(name)  # off the step's lock
        except KeyError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        except ValueError as e:  # AdapterUnreadable, or files that now hold another adapter
            log.error("rank %d: %s", self.config.rank, e)
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        if fetched is not None:
            with self._device_lock:
                self._take_lease(context, "prefetch an adapter on")
                lora.keep(name, fetched)
        return worker_pb2.PrefetchLoRAAdapterResponse()
