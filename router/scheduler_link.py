"""The router's long-lived stream to one scheduler (one model replica).

A link only moves messages: it sends AddRequests, aborts and queue depths on one bidi stream, keeps the
scheduler's credit, and hands everything that comes back (load reports, credit, outputs, a broken
stream) to its owner, the SchedulerPool (router/pool.py), which decides what to send where.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import grpc

from common import security
from common.grpc_util import OPTIONS
from common.pb.tpserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tpserve.v1 import generation_pb2
from common.speed import StackSpeed
from router.buckets import Credits
from router.slo import SloEstimator

log = logging.getLogger("tpserve.router")


class SchedulerUnavailable(Exception):
    pass


class QueueFull(Exception):
    """The router already holds max_queued_requests waiting: RESOURCE_EXHAUSTED, at once."""


class LinkOwner(Protocol):
    slo: SloEstimator  # told the replica's measured speed

    def on_connected(self, link: SchedulerLink) -> None: ...
    def on_load(self, link: SchedulerLink, load: scheduler_pb2.LoadReport) -> None: ...
    def on_kv_events(self, link: SchedulerLink, events: scheduler_pb2.KvEvents) -> None: ...
    def on_credit(self, link: SchedulerLink) -> None: ...
    def on_output(self, link: SchedulerLink, out: scheduler_pb2.RequestOutput) -> None: ...
    def on_lost(self, link: SchedulerLink, reason: str) -> None: ...


class SchedulerLink:
    """One bidi stream to one scheduler, reconnected after retry_s whenever it breaks or is dropped.

    gRPC allows one outstanding write per stream: every message goes into the outbox and the stream's
    request iterator is the single writer.
    """

    def __init__(
        self,
        target: str,
        owner: LinkOwner,
        retry_s: float = 0.5,
        tls: security.TlsFiles | None = None,  # internal mutual TLS
        server_name: str | None = None,  # the name the certificate carries, when target is a resolved IP
    ):
        self.target = target
        self.owner = owner
        self.retry_s = retry_s
        self.model_info: generation_pb2.ModelInfo | None = None
        # A scheduler that is starting or restarting is found within half a second of listening (gRPC's
        # reconnect backoff otherwise grows to seconds while it is down).
        options = [
            *OPTIONS,
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ]
        if tls is not None and server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        self._channel = security.aio_channel(target, tls, options)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._call = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.credits = Credits()
        self._reported_queued: tuple[int, int | None] = (0, None)
        self._dropping = False  # drop() cancelled the call: not the task being cancelled

    @property
    def connected(self) -> bool:
        return self._call is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        await self._channel.close()

    def send(self, add: scheduler_pb2.AddRequest) -> None:
        """Sends a request; the caller has taken one of this link's credits for it."""
        self._outbox.put_nowait(scheduler_pb2.RouterMessage(add=add))

    def abort(self, request_id: str) -> None:
        if self._call is not None:  # if the stream broke, the scheduler dropped the request already
            abort = scheduler_pb2.AbortRequest(request_id=request_id)
            self._outbox.put_nowait(scheduler_pb2.RouterMessage(abort=abort))

    def report_queued(self, queued: int, best_priority: int | None = None) -> None:
        """Tells the scheduler how many requests wait here for it (min_batch_size, static fallback) and
        the highest priority among them (priority preemption)."""
        if (queued, best_priority) != self._reported_queued and self._call is not None:
            self._reported_queued = (queued, best_priority)
            depth = scheduler_pb2.QueueDepth(queued=queued, best_priority=best_priority)
            self._outbox.put_nowait(scheduler_pb2.RouterMessage(queue_depth=depth))

    def drop(self) -> None:
        """Gives up on the stream (the scheduler went silent): cancels it, then reconnects as after a
        break. Cancelling makes the scheduler drop this router's requests, so none runs twice."""
        if self._call is not None:
            self._dropping = True
            self._call.cancel()

    async def _run(self) -> None:
        while True:
            try:
                self.model_info = await self.stub.GetModelInfo(
                    generation_pb2.ModelInfoRequest(), wait_for_ready=True, timeout=5.0
                )
                self._outbox = asyncio.Queue()
                self.credits.reset()
                self._reported_queued = (0, None)
                self._call = self.stub.Connect(self._drain(self._outbox))
                log.info("connected to the scheduler at %s", self.target)
                self.owner.on_connected(self)
                async for msg in self._call:
                    self._receive(msg)
                reason = "stream ended"
            except grpc.RpcError as e:
                reason = f"stream broke ({e.code().name})"
            except asyncio.CancelledError:
                if not self._dropping:
                    raise  # close(): the task itself is cancelled
                reason = "stale"
            except Exception as e:  # a bug handling a message: the link must not die with it
                log.exception("link to the scheduler at %s failed", self.target)
                reason = f"failed ({type(e).__name__}: {e})"
                if self._call is not None:
                    self._call.cancel()  # the scheduler then drops this router's requests: none runs twice
            self._dropping = False
            was_connected, self._call = self._call is not None, None
            if was_connected:
                log.warning("lost the scheduler at %s: %s", self.target, reason)
            self.owner.on_lost(self, reason)
            await asyncio.sleep(self.retry_s)

    def _receive(self, msg: scheduler_pb2.SchedulerMessage) -> None:
        if msg.HasField("model_info"):  # the shards came back, maybe with another max_model_len
            self.model_info = msg.model_info
        if msg.HasField("speed"):
            try:
                # The admission estimates hold from the replica's first request (router/slo.py).
                self.owner.slo.speed(self.target, StackSpeed.from_message(msg.speed))
            except ValueError as e:  # no scheduler sends one; the router measures the replica instead
                log.error("%s: a speed that is not one: %s", self.target, e)
        if msg.HasField("shards_ready"):
            log.log(
                logging.INFO if msg.shards_ready else logging.WARNING,
                "%s: shards %s",
                self.target,
                "ready" if msg.shards_ready else "lost: no new requests go there",
            )
        if msg.HasField("credit"):
            self.credits.update(msg.credit.window, msg.credit.adds_received)
        if msg.HasField("kv_events"):  # before the load: a replica coming up is routed with its index
            self.owner.on_kv_events(self, msg.kv_events)
        if msg.HasField("load"):
            self.owner.on_load(self, msg.load)
        for out in msg.outputs:
            self.owner.on_output(self, out)
        if msg.HasField("credit"):
            self.owner.on_credit(self)

    @staticmethod
    async def _drain(outbox: asyncio.Queue):
        while True:
            yield await outbox.get()
