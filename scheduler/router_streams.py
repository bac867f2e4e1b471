"""The routers' Connect streams, seen from the scheduler: which stream wants which request's tokens, and
what goes out on each — a step's outputs, credit and load in one message.

Credit (how many more requests a router may send, see router/buckets.py Credits) and load reports go
out only when they changed; the heartbeat sends the load regardless, so a router can tell a live
replica in a long step from a dead one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from common.pb.tpserve.internal.v1 import scheduler_pb2

# The heartbeat: a load report at least this often (the router's --replica-stale-s is several times it).
LOAD_REPORT_INTERVAL_S = 0.5


class RouterStream:
    """One router's stream: messages wait in `outbox` for the servicer to write them."""

    def __init__(self):
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.adds_received = 0  # AddRequests read from this stream (stamped on credit and load)
        self.queued = 0  # requests the router holds in its queue for lack of credit (its QueueDepth)
        self._last_credit: tuple[int, int] | None = None
        self._last_load: tuple | None = None

    def send(self, msg: scheduler_pb2.SchedulerMessage) -> None:
        self.outbox.put_nowait(msg)

    def message(
        self,
        outputs: list[scheduler_pb2.RequestOutput],
        window: int | None,
        load: scheduler_pb2.LoadReport | None,
        force_load: bool = False,
    ) -> scheduler_pb2.SchedulerMessage | None:
        """One message with the outputs, the credit if it changed and the load if it changed (or
        force_load); None when there is nothing to say."""
        msg = scheduler_pb2.SchedulerMessage(outputs=outputs)
        if window is not None and (window, self.adds_received) != self._last_credit:
            self._last_credit = (window, self.adds_received)
            msg.credit.window, msg.credit.adds_received = window, self.adds_received
        if load is not None:
            key = (
                load.waiting,
                load.swapped,
                load.running,
                load.kv_blocks_free,
                load.kv_blocks_total,
                load.shards_ready,
                round(load.step_seconds, 3),
            )
            if force_load or key != self._last_load:
                self._last_load = key
                msg.load.CopyFrom(load)
                msg.load.adds_received = self.adds_received
        empty = not (outputs or msg.HasField("credit") or msg.HasField("load"))
        return None if empty else msg


class RouterStreams:
    """Every router connected to this scheduler, and which one each request in flight belongs to."""

    def __init__(self):
        self._streams: set[RouterStream] = set()
        self._owner: dict[str, RouterStream] = {}  # request id -> the stream that wants its tokens

    def attach(self, stream: RouterStream) -> None:
        self._streams.add(stream)

    def detach(self, stream: RouterStream) -> list[str]:
        """Forgets the stream; returns the requests it owned (the engine aborts them)."""
        self._streams.discard(stream)
        return [r for r, s in self._owner.items() if s is stream]

    def bind(self, request_id: str, stream: RouterStream) -> None:
        self._owner[request_id] = stream

    def release(self, request_id: str) -> RouterStream | None:
        return self._owner.pop(request_id, None)

    @property
    def request_ids(self) -> list[str]:
        return list(self._owner)

    def queued(self) -> int:
        """Requests the routers hold for lack of credit: on their way here."""
        return sum(s.queued for s in self._streams)

    def shards_ready(self, ready: bool, model_info=None, stream: RouterStream | None = None) -> None:
        """The shards' state, with the model's description when known (its limits may have changed)."""
        for s in [stream] if stream is not None else self._streams:
            msg = scheduler_pb2.SchedulerMessage(shards_ready=ready)
            if model_info is not None:
                msg.model_info.CopyFrom(model_info)
            s.send(msg)

    def publish(
        self,
        outputs: Iterable[scheduler_pb2.RequestOutput],
        window: int | None,
        load: scheduler_pb2.LoadReport | None,
        force_load: bool = False,
    ) -> None:
        """Sends each router its outputs of a step with the credit and load, one message each.
        Outputs of requests no router owns any more are dropped."""
        mine: dict[RouterStream, list] = {s: [] for s in self._streams}
        for out in outputs:
            stream = self._owner.get(out.request_id)
            if stream in mine:
                mine[stream].append(out)
        for stream, outs in mine.items():
            msg = stream.message(outs, window, load, force_load)
            if msg is not None:
                stream.send(msg)
