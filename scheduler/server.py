"""The scheduler process: a thin gRPC servicer over the Engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import metrics, security, tracing
from common.grpc_util import SERVER_OPTIONS, check_ports_free, write_port_file
from common.pb.tpserve.internal.v1 import scheduler_pb2_grpc
from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_INTERNAL
from common.pb.tpserve.v1 import generation_pb2
from scheduler import config as scheduler_config
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.lora_admin import LoRAError
from scheduler.router_streams import RouterStream
from scheduler.tasks import TaskEnded, first_to_end, log_failure
from scheduler.workers import WorkerGroup

log = logging.getLogger("tpserve.scheduler")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Connect(self, request_iterator, context):
        router = RouterStream()
        reader = asyncio.create_task(self._read(request_iterator, router))
        # A reader that stops (the router closed its side, or an error) ends this stream too, so the
        # router sees it end and reconnects, rather than heartbeats flowing while its adds go unread.
        reader.add_done_callback(lambda _: router.outbox.put_nowait(None))
        reader.add_done_callback(log_failure)  # it survives a bad message: an error here is a bug
        self.engine.attach(router)
        try:
            while (msg := await router.outbox.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            self.engine.detach(router)

    async def _read(self, request_iterator, router: RouterStream) -> None:
        async for msg in request_iterator:
            try:
                self._handle(msg, router)
            except Exception as e:  # a bug: that request fails, the stream goes on
                log.exception("scheduler: handling a router message failed")
                if msg.HasField("add"):
                    self.engine.refuse(
                        router, msg.add.request_id, ERROR_CODE_INTERNAL, f"the scheduler failed: {e}"
                    )

    def _handle(self, msg, router: RouterStream) -> None:
        if msg.HasField("add"):
            self.engine.add(msg.add, router)
        elif msg.HasField("abort"):
            self.engine.abort(msg.abort.request_id)
        elif msg.HasField("queue_depth"):
            router.queued = msg.queue_depth.queued
            has_best = msg.queue_depth.HasField("best_priority")
            router.best_priority = msg.queue_depth.best_priority if has_best else None
            self.engine.queued_changed()

    async def GetModelInfo(self, request, context):
        if not self.engine.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shard workers are not ready")
        return self.engine.model_info

    async def GetStats(self, request, context):
        return self.engine.stats()

    async def LoadLoRAAdapter(self, request, context):
        try:
            await self.engine.loras.load(request.lora_name, request.lora_path, self.engine.ready.is_set())
        except LoRAError as e:
            await context.abort(e.code, e.message)
        return generation_pb2.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(self, request, context):
        try:
            finishing = await self.engine.loras.unload(request.lora_name)
        except LoRAError as e:
            await context.abort(e.code, e.message)
        return generation_pb2.UnloadLoRAAdapterResponse(requests_finishing=finishing)


async def serve(config: SchedulerConfig) -> None:
    check_ports_free(config.host, {"--port": config.port, "--metrics-port": config.metrics_port})
    provider = tracing.setup(config.tracing, "scheduler")
    engine = Engine(config)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(engine), server)
    # Standard health (Kubernetes probes): SERVING once every rank has been described and the step
    # streams are open; NOT_SERVING before, and after a rank is lost.
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = security.add_port(server, f"{config.host}:{config.port}", config.internal_tls)
    if isinstance(engine.workers, WorkerGroup):  # its name to the workers: where it serves
        engine.workers.name_as(f"{socket.gethostname()}:{port}")
    await server.start()
    metrics_port = metrics.serve(engine.metrics.registry, config.host, config.metrics_port)
    write_port_file(config.port_file, port, metrics_port)
    log.info("scheduler serving on %s:%d; workers %s", config.host, port, ", ".join(config.workers))
    if metrics_port is not None:
        log.info("scheduler metrics on http://%s:%d/metrics", config.host, metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def on_status(ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        asyncio.ensure_future(health_servicer.set("", status)).add_done_callback(log_failure)

    engine.watch_status(on_status)

    # Every task of the process supervised (scheduler/tasks.py): one that fails ends the process loudly.
    tasks = {"engine": engine.serve_forever(), "load reports": engine.heartbeat(), "signal": stop.wait()}
    try:
        ended = await first_to_end(tasks)
        if ended != "signal":
            raise TaskEnded(f"the scheduler's {ended} task returned")
    except Exception as e:
        if isinstance(e, ValueError) and engine.scheduler is None:
            raise  # the ranks do not fit the configuration at start: one line, exit 2 (common/cli.py)
        log.critical(
            "scheduler failed: %s; exiting (the launcher or Kubernetes restarts it; the routers resume "
            "its requests)",
            e,
            exc_info=True,
        )
        raise SystemExit(1) from None  # a bug, not a misconfiguration: never cli's one line and exit 2
    finally:
        await server.stop(grace=1.0)
        await engine.close()
        if provider is not None:
            provider.shutdown()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`tpserve scheduler`'s flags (common/cli.py)."""
    scheduler_config.add_arguments(p)


def main(a: argparse.Namespace) -> None:
    asyncio.run(serve(scheduler_config.from_args(a)))
