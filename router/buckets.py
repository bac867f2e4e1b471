"""The router's admission queue: requests wait here, bucketed by prompt length, until the scheduler has room.

Who is admitted next is decided here, not in the scheduler (which only ever receives as many requests as
it has credit for, see `Credits`):
- higher priority first (the request's `priority`, vLLM's sense: lower value first, default 0);
- within a priority, shortest bucket first, so interactive prompts keep a low time to first token behind
  long ones; FIFO within a bucket;
- aging: a request that has waited longer than max_wait_s goes before every newer one, whatever its
  bucket and priority (the oldest overdue first), so neither a long prompt nor a low priority is ever
  starved by a stream of short or higher-priority ones: no request waits here much past max_wait_s
  beyond the time to serve the overdue requests that arrived before it. Past that bound, under a backlog
  that stays overdue, the order is first come, first served (with latency objectives the admission
  estimate keeps the backlog short of that: router/slo.py).
- a bound: at most max_queued requests wait; past that, push refuses and the router answers
  RESOURCE_EXHAUSTED at once.

Plain Python, no gRPC and no asyncio: the clock is an argument (`now`, from time.monotonic()), so the
policy is tested without sleeping. Times must not go backwards between calls (a monotonic clock).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from itertools import count
from typing import Any

from common.settings import Rule, at_least, setting, validate


@dataclass(frozen=True)
class BucketStats:
    """One bucket's load, for GetStats and metrics."""

    name: str  # the token range, e.g. "0-511", "512-2047", "2048+": readable and a stable metric label
    lower: int  # smallest prompt length in the bucket (inclusive)
    upper: int | None  # first prompt length past the bucket (exclusive); None for the last, unbounded one
    waiting: int
    oldest_wait_s: float  # how long the bucket's oldest request has waited; 0.0 when it is empty


@dataclass
class _Entry:
    item: Any
    key: Hashable
    bucket: int
    priority: int
    arrival: float
    order: int  # push order across buckets: ties in arrival time go to the earlier push


def _increasing(edges: tuple[int, ...]) -> bool:
    return all(b > a for a, b in zip(edges, edges[1:], strict=False))


@dataclass(frozen=True)
class AdmissionPolicy:
    """The queue's knobs, declared once (the router's and `tpserve launch`'s flags)."""

    bucket_edges: tuple[int, ...] = setting(
        (512, 2048),
        help="prompt-length bucket edges in tokens, comma-separated (shortest bucket admitted first)",
        rule=Rule(lambda e: isinstance(e, int) and not isinstance(e, bool) and e > 0, "positive integers"),
        launch=True,
    )
    max_queued_requests: int = setting(
        1024,
        help="requests waiting in the router at most; past that new ones get RESOURCE_EXHAUSTED",
        rule=at_least(1),
        launch=True,
    )
    # Finite on purpose: an unbounded wait would let a stream of short prompts starve a long one.
    max_queue_wait_ms: float = setting(
        2000.0,
        help="a request waiting longer than this is admitted before any newer one (no starvation)",
        rule=at_least(0),
        launch=True,
    )

    def __post_init__(self):
        validate(self)
        if not _increasing(self.bucket_edges):
            raise ValueError(f"--bucket-edges must be strictly increasing, got {self.bucket_edges}")


def bucket_name(lower: int, upper: int | None) -> str:
    return f"{lower}+" if upper is None else f"{lower}-{upper - 1}"


class AdmissionQueue:
    """FIFO queues per (priority, bucket) with aging and a bound on the total.

    Operations: push O(log edges), pop O(priorities x buckets) (priorities: the distinct values waiting,
    few in practice), remove O(1) (each queue is an OrderedDict keyed by the request's key), len O(1),
    stats O(priorities x buckets).
    """

    def __init__(self, policy: AdmissionPolicy | None = None):
        policy = policy or AdmissionPolicy()
        self.edges = policy.bucket_edges
        self.max_queued = policy.max_queued_requests
        self.max_wait_s = policy.max_queue_wait_ms / 1000.0
        bounds = (0, *self.edges, None)
        self._bounds: list[tuple[int, int | None]] = list(zip(bounds[:-1], bounds[1:], strict=True))
        # priority -> one FIFO per bucket; a priority with nothing waiting is dropped.
        self._queues: dict[int, list[OrderedDict[Hashable, _Entry]]] = {}
        self._where: dict[Hashable, _Entry] = {}  # for remove and __contains__
        self._order = count()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._where

    def bucket_of(self, prompt_tokens: int) -> int:
        """Index of the bucket a prompt of this many tokens goes to (0: the shortest)."""
        return bisect_right(self.edges, prompt_tokens)

    def push(
        self, item: Any, prompt_tokens: int, now: float, key: Hashable | None = None, priority: int = 0
    ) -> bool:
        """Queues item; False (and nothing queued) when max_queued requests already wait.

        key identifies the item for remove (the request id); it defaults to the item itself. A key
        already queued is a ValueError: the router answers ALREADY_EXISTS before pushing.
        """
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
        key = item if key is None else key
        if key in self._where:
            raise ValueError(f"{key!r} is already queued")
        if len(self._where) >= self.max_queued:
            return False
        entry = _Entry(item, key, self.bucket_of(prompt_tokens), priority, now, next(self._order))
        self._queue(entry)[key] = entry
        self._where[key] = entry
        return True

    def best_priority(self) -> int | None:
        """The highest priority waiting (the lowest value); None when none waits."""
        return min(self._queues, default=None)

    def ahead(self, prompt_tokens: int, priority: int = 0) -> int:
        """How many queued requests leave before one pushed now with this prompt length and priority
        (those of higher priority, and of its own in its bucket or a shorter one), aging aside."""
        b = self.bucket_of(prompt_tokens)
        return sum(
            len(q)
            for p, queues in self._queues.items()
            if p <= priority
            for q in queues[: None if p < priority else b + 1]
        )

    def requeue(
        self, item: Any, prompt_tokens: int, arrival: float, key: Hashable | None = None, priority: int = 0
    ) -> None:
        """Puts back a request that was popped but could not run (its replica failed before it streamed
        anything), with its original arrival time: ahead of every later arrival in its queue, and aged
        from when it first came. Never refused: the request was accepted once already.
        """
        key = item if key is None else key
        if key in self._where:
            raise ValueError(f"{key!r} is already queued")
        entry = _Entry(item, key, self.bucket_of(prompt_tokens), priority, arrival, next(self._order))
        queue = self._queue(entry)
        later = [e for e in queue.values() if e.arrival > arrival]  # rare: failover only, O(queue)
        for e in later:
            del queue[e.key]
        queue[key] = entry
        for e in later:
            queue[e.key] = e
        self._where[key] = entry

    def pop(self, now: float) -> Any | None:
        """Removes and returns the request to admit next, or None when none waits.

        Each queue's head is its oldest entry, so the oldest request overall is the oldest head: if it
        has waited longer than max_wait_s it goes first (and no other can be more overdue); otherwise
        the head of the highest priority's shortest non-empty bucket goes.
        """
        heads = [next(iter(q.values())) for p in sorted(self._queues) for q in self._queues[p] if q]
        if not heads:
            return None
        oldest = min(heads, key=lambda e: (e.arrival, e.order))  # requeued entries keep their arrival
        chosen = oldest if now - oldest.arrival > self.max_wait_s else heads[0]
        self._take(chosen)
        return chosen.item

    def remove(self, key: Hashable) -> Any | None:
        """Drops a queued request (cancelled, disconnected, past its deadline) in O(1).

        Returns its item, or None when the key is not queued (already popped, or never queued): a
        request already popped belongs to the scheduler, and the router sends it an AbortRequest instead.
        """
        entry = self._where.get(key)
        if entry is None:
            return None
        self._take(entry)
        return entry.item

    def stats(self, now: float) -> list[BucketStats]:
        """Per bucket, shortest first: how many wait and for how long the oldest has."""
        out = []
        for b, (lower, upper) in enumerate(self._bounds):
            queues = [qs[b] for qs in self._queues.values() if qs[b]]
            first = min((next(iter(q.values())).arrival for q in queues), default=now)
            waiting = sum(len(q) for q in queues)
            out.append(BucketStats(bucket_name(lower, upper), lower, upper, waiting, max(0.0, now - first)))
        return out

    def _queue(self, entry: _Entry) -> OrderedDict[Hashable, _Entry]:
        if entry.priority not in self._queues:
            self._queues[entry.priority] = [OrderedDict() for _ in self._bounds]
        return self._queues[entry.priority][entry.bucket]

    def _take(self, entry: _Entry) -> None:
        queues = self._queues[entry.priority]
        del queues[entry.bucket][entry.key]
        del self._where[entry.key]
        if not any(queues):
            del self._queues[entry.priority]


class Credits:
    """How many more requests the scheduler will take: credit-based flow control on the Connect stream.

    The scheduler reports, after each step, `window` (how many more requests it wants now) together
    with `received` (how many AddRequests it had read from this stream when it computed the window).
    Adds the router sent after that are still on the wire and use up part of that window, so the router
    may send `window - (sent - received)` more. An absolute report acknowledged this way is idempotent:
    a late or repeated report can never make the router over-send or drift, which a plain running
    `available` counter (or deltas) could if a report crossed adds in flight.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """A new stream: the scheduler counts from zero again and has granted nothing yet."""
        self.sent = 0
        self._received = 0
        self._window = 0

    def update(self, window: int, received: int) -> None:
        if window < 0 or received < 0:
            raise ValueError(f"credit window ({window}) and received ({received}) must be >= 0")
        if received > self.sent:
            raise ValueError(
                f"the scheduler acknowledges {received} requests, but only {self.sent} were sent"
            )
        if received < self._received:
            return  # an older report than one already applied (cannot happen on one ordered stream)
        self._window, self._received = window, received

    @property
    def available(self) -> int:
        return max(0, self._window - (self.sent - self._received))

    def take(self) -> bool:
        """Spends one credit for a request about to be sent; False when there is none."""
        if self.available <= 0:
            return False
        self.sent += 1
        return True
