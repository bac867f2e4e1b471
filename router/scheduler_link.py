"""The router's one long-lived stream to the scheduler, and the per-request queues it feeds."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common import security
from common.grpc_util import OPTIONS
from common.pb.tpserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tpserve.v1 import generation_pb2
from router.buckets import AdmissionQueue, Credits, admit

log = logging.getLogger("tpserve.router")


class SchedulerUnavailable(Exception):
    pass


class QueueFull(Exception):
    """The router already holds max_queued_requests waiting: RESOURCE_EXHAUSTED, at once."""


class SchedulerLink:
    """Sends requests and aborts on one bidi stream; routes each output to its request's queue.

    Requests wait in the length-bucketed admission queue until the scheduler grants credit, so the
    bucket order (short first, aged long ones never starved) decides who is admitted next. When the
    stream breaks, every request in flight or queued gets an UNAVAILABLE output (none is dropped
    silently) and the link reconnects; on_ready(bool) follows the state, for the health service.
    """

    def __init__(
        self,
        target: str,
        on_ready,
        admission: AdmissionQueue,
        retry_s: float = 0.5,
        tls: security.TlsFiles | None = None,  # internal mutual TLS
    ):
        self.target = target
        self.on_ready = on_ready
        self.retry_s = retry_s
        self.model_info: generation_pb2.ModelInfo | None = None
        self._channel = security.aio_channel(target, tls, OPTIONS)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._call = None
        # gRPC allows one outstanding write per stream: every request handler puts its message here
        # and the stream's request iterator is the single writer.
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self.admission = admission
        self._credits = Credits()
        self._reported_depth = 0
        self.on_admit = lambda add, waited_s: None  # the servicer's metrics hook
        # The scheduler says whether every rank is serving; while one is lost, requests in flight
        # wait for it (the scheduler recomputes them) and new ones get UNAVAILABLE.
        self._shards_ready = False

    @property
    def ready(self) -> bool:
        return self._call is not None and self.model_info is not None and self._shards_ready

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        await self._channel.close()

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._queues

    def submit(self, add: scheduler_pb2.AddRequest) -> asyncio.Queue:
        """Queues the request for admission; its outputs arrive on the returned queue."""
        if not self.ready:
            raise SchedulerUnavailable("the scheduler is not ready")
        if not self.admission.push(
            (add, time.monotonic()), len(add.prompt_token_ids), time.monotonic(), add.request_id
        ):
            raise QueueFull(f"{len(self.admission)} requests are already waiting; try again later")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[add.request_id] = queue
        self._pump()
        return queue

    def _pump(self) -> None:
        """Sends as many queued requests as the scheduler has credit for, in the buckets' order."""
        now = time.monotonic()
        for add, queued_at in admit(self.admission, self._credits, now):
            self.on_admit(add, now - queued_at)
            self._outbox.put_nowait(scheduler_pb2.RouterMessage(add=add))
        self._report_depth()

    def _report_depth(self) -> None:
        if len(self.admission) != self._reported_depth and self._call is not None:
            self._reported_depth = len(self.admission)
            depth = scheduler_pb2.QueueDepth(waiting=self._reported_depth)
            self._outbox.put_nowait(scheduler_pb2.RouterMessage(queue_depth=depth))

    def abort(self, request_id: str) -> None:
        """The router no longer wants request_id (finished by stop string, cancelled, disconnected)."""
        if self._queues.pop(request_id, None) is None:
            return
        if self.admission.remove(request_id) is not None:
            self._report_depth()
            return  # never sent: nothing to tell the scheduler
        if self._call is not None:
            # If the stream breaks first, the scheduler drops everything of this router anyway.
            abort = scheduler_pb2.AbortRequest(request_id=request_id)
            self._outbox.put_nowait(scheduler_pb2.RouterMessage(abort=abort))

    def done(self, request_id: str) -> None:
        """The request ended normally: stop routing to it."""
        self._queues.pop(request_id, None)

    async def _run(self) -> None:
        while True:
            try:
                self.model_info = await self._stub.GetModelInfo(
                    generation_pb2.ModelInfoRequest(), wait_for_ready=True, timeout=5.0
                )
                self._outbox = asyncio.Queue()
                self._credits.reset()
                self._reported_depth = 0
                self._call = self._stub.Connect(self._drain(self._outbox))
                log.info("connected to the scheduler at %s", self.target)
                async for msg in self._call:
                    if msg.HasField("shards_ready") and msg.shards_ready != self._shards_ready:
                        self._shards_ready = msg.shards_ready
                        self.on_ready(msg.shards_ready)
                        log.log(
                            logging.INFO if msg.shards_ready else logging.WARNING,
                            "shards %s",
                            "ready" if msg.shards_ready else "lost: new requests get UNAVAILABLE",
                        )
                    if msg.HasField("credit"):
                        self._credits.update(msg.credit.window, msg.credit.adds_received)
                        self._pump()
                    for out in msg.outputs:
                        queue = self._queues.get(out.request_id)
                        if queue is not None:
                            queue.put_nowait(out)
                            if out.finish_reason or out.error:
                                self._queues.pop(out.request_id, None)
            except grpc.RpcError as e:
                if self.ready:
                    log.warning("lost the scheduler at %s: %s", self.target, e.code())
            self._call = None
            self._shards_ready = False
            self.on_ready(False)
            self._fail_all("the scheduler is unavailable")
            await asyncio.sleep(self.retry_s)

    @staticmethod
    async def _drain(outbox: asyncio.Queue):
        while True:
            yield await outbox.get()

    def _fail_all(self, message: str) -> None:
        while self.admission.pop(float("inf")) is not None:
            pass  # queued requests fail too: they would wait for a scheduler that may not come back
        queues, self._queues = self._queues, {}
        for request_id, queue in queues.items():
            queue.put_nowait(
                scheduler_pb2.RequestOutput(request_id=request_id, error=message, error_code="UNAVAILABLE")
            )
