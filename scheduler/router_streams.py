"""The routers' Connect streams, seen from the scheduler: which stream wants which request's tokens, and
what goes out on each — a step's outputs, credit, load and prefix-cache events in one message.

Prefix-cache events (common/kv_events.py): each router gets the cache's net change with every message
that follows a change, and a snapshot (every hash held, reset) first thing on its stream and whenever
the cache was replaced, so its index of the replica (router/cache_index.py) stays exact.

Credit (how many more requests a router may send, see router/buckets.py Credits) and load reports go
out only when they changed; the heartbeat sends the load regardless, so a router can tell a live
replica in a long step from a dead one.

The admission window is the scheduler's, not each router's: with several routers connected it is split
among them by what they queue (`split_window`). A router with nothing queued gets no share until it
reports a queue (one round trip), and what it was granted before is not kept for it: an idle router
that once had the whole window must not starve the others (it cannot give credit back). So the routers
together send at most the window, plus, once, whatever an idle router still sends under an old credit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from common.kv_events import KvEvents
from common.load import ReplicaLoad
from common.pb.tpserve.internal.v1 import scheduler_pb2

# The heartbeat: a load report at least this often (the router's --replica-stale-s is several times it).
LOAD_REPORT_INTERVAL_S = 0.5


def split_window(window: int, queued: list[int], floors: list[int]) -> list[int]:
    """Each router's share of the admission window. floors: what each may still send under the last
    credit it was given (RouterStream.outstanding); a share never drops below it, so the routers'
    unreceived adds never add up to more than the window. The rest goes to the requests they queue
    beyond that, in proportion when there are more than the rest (largest remainders, then the longest
    queues). One router alone gets the whole window, as before there were several."""
    n = len(queued)
    if n == 1:
        return [window]
    rest = window - sum(floors)
    if rest <= 0:
        return list(floors)
    want = [max(0, q - f) for q, f in zip(queued, floors, strict=True)]
    total = sum(want)
    if total <= rest:
        return [f + w for f, w in zip(floors, want, strict=True)]
    extra = [rest * w // total for w in want]
    left = rest - sum(extra)  # fewer than n
    order = sorted(range(n), key=lambda i: (-(rest * want[i] % total), -want[i]))
    for i in order[:left]:
        extra[i] += 1
    return [f + e for f, e in zip(floors, extra, strict=True)]


class RouterStream:
    """One router's stream: messages wait in `outbox` for the servicer to write them."""

    def __init__(self):
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.adds_received = 0  # AddRequests read from this stream (stamped on credit and load)
        self.queued = 0  # requests the router holds in its queue for lack of credit (its QueueDepth)
        self.best_priority: int | None = None  # the highest priority among them (None: none queued)
        self._last_credit: tuple[int, int] | None = None
        self._last_load: ReplicaLoad | None = None
        self.needs_snapshot = True  # of the prefix cache: the router knows nothing of it yet

    def outstanding(self) -> int:
        """How many adds the router may still send under the last credit it was given (some may be on
        the wire already): that credit's window less the adds read since it was computed."""
        if self._last_credit is None:
            return 0
        window, received = self._last_credit
        return max(0, window - (self.adds_received - received))

    def send(self, msg: scheduler_pb2.SchedulerMessage) -> None:
        self.outbox.put_nowait(msg)

    def message(
        self,
        outputs: list[scheduler_pb2.RequestOutput],
        window: int | None,
        load: ReplicaLoad | None,
        force_load: bool = False,
        kv: KvEvents | None = None,
    ) -> scheduler_pb2.SchedulerMessage | None:
        """One message with the outputs, the credit if it changed, the load if it changed (or
        force_load) and the prefix-cache events if any; None when there is nothing to say."""
        msg = scheduler_pb2.SchedulerMessage(outputs=outputs)
        if kv:
            kv.fill(msg.kv_events)
        if window is not None and (window, self.adds_received) != self._last_credit:
            self._last_credit = (window, self.adds_received)
            msg.credit.window, msg.credit.adds_received = window, self.adds_received
        if load is not None and (force_load or load != self._last_load):
            self._last_load = load
            load.fill(msg.load)
            msg.load.adds_received = self.adds_received
        empty = not (outputs or msg.HasField("credit") or msg.HasField("load") or kv)
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

    def best_priority(self) -> int | None:
        """The highest priority any router holds for lack of credit (None: none queued)."""
        return min((s.best_priority for s in self._streams if s.best_priority is not None), default=None)

    def shards_ready(self, ready: bool, model_info=None, stream: RouterStream | None = None) -> None:
        """The shards' state, with the model's description when known (its limits may have changed)."""
        for s in [stream] if stream is not None else self._streams:
            msg = scheduler_pb2.SchedulerMessage(shards_ready=ready)
            if model_info is not None:
                msg.model_info.CopyFrom(model_info)
            s.send(msg)

    def shares(self, window: int | None) -> dict[RouterStream, int | None]:
        """Each connected router's share of the scheduler's admission window (split_window)."""
        streams = sorted(self._streams, key=id)  # a stable order between calls
        if window is None:
            return dict.fromkeys(streams)
        queued = [s.queued for s in streams]
        # What a router with a queue may have on the wire stays its; an idle one's old credit does not.
        floors = [s.outstanding() if s.queued else 0 for s in streams]
        return dict(zip(streams, split_window(window, queued, floors), strict=True))

    def publish(
        self,
        outputs: Iterable[scheduler_pb2.RequestOutput],
        window: int | None,
        load: ReplicaLoad | None,
        force_load: bool = False,
        kv: KvEvents | None = None,
        cached: Callable[[], KvEvents] | None = None,
    ) -> None:
        """Sends each router its outputs of a step with its share of the credit, the load and the
        prefix cache's change (kv), one message each. Outputs of requests no router owns any more are
        dropped. cached(): a snapshot of every hash the cache holds, for a router's first message; None
        while there is no cache (the ranks have not reported yet). A change with reset set (a new cache,
        whose log began with it) is itself a snapshot."""
        snapshot = None
        shares = self.shares(window)
        mine: dict[RouterStream, list] = {s: [] for s in shares}
        for out in outputs:
            stream = self._owner.get(out.request_id)
            if stream in mine:
                mine[stream].append(out)
        for stream, outs in mine.items():
            events = kv
            if cached is None:
                events = None
            elif stream.needs_snapshot:
                if snapshot is None:
                    snapshot = cached()
                events, stream.needs_snapshot = snapshot, False
            msg = stream.message(outs, shares[stream], load, force_load, events)
            if msg is not None:
                stream.send(msg)
