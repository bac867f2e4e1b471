"""The routers' Connect streams, seen from the scheduler: which stream wants which request's tokens, and
what goes out on each — a step's outputs, credit, load and prefix-cache events in one message.

Prefix-cache events (common/kv_events.py): each router gets the cache's net change with every message
that follows a change, and a snapshot (every hash held, reset) first thing on its stream and whenever
the cache was replaced, so its index of the replica (router/cache_index.py) stays exact.

Credit (how many more requests a router may send, see router/buckets.py Credits) and load reports go
out only when they changed; the heartbeat sends the load regardless, so a router can tell a live
replica in a long step from a dead one.

The admission window is the scheduler's, not each router's: with several routers connected it is split
among them by what they queue, their priority and how long they waited (`split_window`). A router with
nothing queued gets no share until it reports a queue (one round trip), and what it was granted before
is not kept for it: an idle router that once had the whole window must not starve the others (it cannot
give credit back). So the routers together send at most the window, plus, once, whatever an idle router
still sends under an old credit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.kv_events import KvEvents
from common.load import ReplicaLoad
from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.speed import StackSpeed

log = logging.getLogger("tpserve.scheduler")

# The heartbeat: a load report at least this often (the router's --replica-stale-s is several times it).
LOAD_REPORT_INTERVAL_S = 0.5


def speed_of(describes) -> StackSpeed:
    """The replica's speed, the slowest of its ranks' DescribeResponses (not measured when a rank sent
    none, or one no worker measures: logged, and the routers wait for requests to measure it)."""
    try:
        speed = StackSpeed.slowest([StackSpeed.from_message(d) for d in describes])
    except ValueError as e:
        log.error("a shard worker described a speed that is not one (%s): the routers measure it", e)
        return StackSpeed()
    if speed.known:
        steps = ", ".join(f"{s * 1000:.1f} ms at {n}" for n, s in speed.decode)
        log.info(
            "measured speed: prefill %.0f tokens/s; decode step %s", speed.prefill_tokens_per_second, steps
        )
    return speed


@dataclass(frozen=True)
class RouterWant:
    """What one router asks of the admission window when the scheduler splits it (split_window)."""

    queued: int  # requests it holds for lack of credit (its QueueDepth)
    floor: int = 0  # what it may still send under the last credit it was given (RouterStream.outstanding)
    priority: int | None = None  # the best priority among them (lower first; None: none reported)
    waited_s: float = 0.0  # since it was last granted new credit while it queued
    preempts: int = 0  # places beyond the window its best request would take by preempting (priority.py)


def split_window(window: int, wants: list[RouterWant]) -> list[int]:
    """Each router's share of the admission window. A share never drops below the router's floor, so
    the routers' unreceived adds never add up to more than the window. Then:
    - places that exist only by preemption (running sequences of lower priority than a router's best
      request) go to the routers whose best request outranks them, the best first: they are the same
      running sequences, so what one router takes the next cannot;
    - the rest of the window is levelled: each seat goes to the router with the smallest share that
      still queues more than it holds, ties broken by priority, then by how long it has waited, then
      by the shorter queue. A router with one request waiting gets a seat before a router with five
      gets its second, whatever the window (dividing by queue length gave (1, [1, 5]) -> [0, 1]).
    Never more in total than the window plus those preemptive places. One router alone gets the whole
    window and its own preemptive places, as before there were several."""
    if len(wants) == 1:
        return [window + wants[0].preempts]
    shares = [w.floor for w in wants]
    need = [max(0, w.queued - w.floor) for w in wants]

    def rank(i: int) -> tuple:
        w = wants[i]
        return (w.priority is None, w.priority or 0, -w.waited_s, need[i], i)

    order = sorted(range(len(wants)), key=rank)
    taken = 0
    for i in order:
        give = max(0, min(need[i], wants[i].preempts - taken))
        shares[i], need[i], taken = shares[i] + give, need[i] - give, taken + give
    rest = window - sum(w.floor for w in wants)
    while rest > 0:
        open_ = [i for i in order if need[i] > 0]
        if not open_:
            break
        i = min(open_, key=lambda j: (shares[j], order.index(j)))
        shares[i], need[i], rest = shares[i] + 1, need[i] - 1, rest - 1
    return shares


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
        self._waiting_since: float | None = None  # since it queued without new credit (None: no queue)

    def waited(self, now: float) -> float:
        """How long the router has queued requests without being granted new credit (0: none queued)."""
        if not self.queued:
            self._waiting_since = None
            return 0.0
        if self._waiting_since is None:
            self._waiting_since = now
        return now - self._waiting_since

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
        self.speed = StackSpeed()  # the ranks' (speed_of), sent with the model's description

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
                self.speed.fill(msg.speed)
            s.send(msg)

    def shares(
        self, window_for: Callable[[int | None], int] | None, now: float | None = None
    ) -> dict[RouterStream, int | None]:
        """Each connected router's share of the scheduler's admission window (split_window).
        window_for(p): the credit the scheduler has for a router whose best queued request has priority
        p (None: none), the free slots and the places p would take by preemption."""
        streams = sorted(self._streams, key=id)  # a stable order between calls
        if window_for is None:
            return dict.fromkeys(streams)
        now, window = time.monotonic() if now is None else now, window_for(None)
        wants = [
            RouterWant(
                queued=s.queued,
                # What a router with a queue may have on the wire stays its; an idle one's old credit
                # does not.
                floor=s.outstanding() if s.queued else 0,
                priority=s.best_priority,
                waited_s=s.waited(now),
                preempts=window_for(s.best_priority) - window if s.queued else 0,
            )
            for s in streams
        ]
        split = split_window(window, wants)
        for s, share, want in zip(streams, split, wants, strict=True):
            if s.queued and share > want.floor:
                s._waiting_since = now  # granted new credit: its wait starts again
        return dict(zip(streams, split, strict=True))

    def publish(
        self,
        outputs: Iterable[scheduler_pb2.RequestOutput],
        window_for: Callable[[int | None], int] | None,
        load: ReplicaLoad | None,
        force_load: bool = False,
        kv: KvEvents | None = None,
        cached: Callable[[], KvEvents] | None = None,
    ) -> None:
        """Sends each router its outputs of a step with its share of the credit, the load and the
        prefix cache's change (kv), one message each. Outputs of requests no router owns any more are
        dropped (window_for: as for `shares`). cached(): a snapshot of every hash the cache holds, for a
        router's first message; None while there is no cache (the ranks have not reported yet). A change
        with reset set (a new cache, whose log began with it) is itself a snapshot."""
        snapshot = None
        shares = self.shares(window_for)
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
