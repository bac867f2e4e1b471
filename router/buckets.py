"""The router's admission queue: requests wait here, bucketed by prompt length, until the scheduler has room.

Who is admitted next is decided here, not in the scheduler (which only ever receives as many requests as
it has credit for, see `Credits`):
- shortest bucket first, so interactive prompts keep a low time to first token behind long ones;
- FIFO within a bucket;
- aging: a request that has waited longer than max_wait_s goes before every newer one, whatever its
  bucket (the oldest overdue first), so a long prompt is never starved by a stream of short ones.
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
    """Bucketed FIFO queues with aging and a bound on the total.

    Operations: push O(log edges), pop O(buckets), remove O(1) (each bucket is an OrderedDict keyed by
    the request's key), len O(1), stats O(buckets).
    """

    def __init__(self, policy: AdmissionPolicy | None = None):
        policy = policy or AdmissionPolicy()
        self.edges = policy.bucket_edges
        self.max_queued = policy.max_queued_requests
        self.max_wait_s = policy.max_queue_wait_ms / 1000.0
        bounds = (0, *self.edges, None)
        self._bounds: list[tuple[int, int | None]] = list(zip(bounds[:-1], bounds[1:], strict=True))
        self._buckets: list[OrderedDict[Hashable, _Entry]] = [OrderedDict() for _ in self._bounds]
        self._where: dict[Hashable, int] = {}  # key -> bucket index, for remove and __contains__
        self._order = count()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._where

    def bucket_of(self, prompt_tokens: int) -> int:
        """Index of the bucket a prompt of this many tokens goes to (0: the shortest)."""
        return bisect_right(self.edges, prompt_tokens)

    def push(self, item: Any, prompt_tokens: int, now: float, key: Hashable | None = None) -> bool:
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
        b = self.bucket_of(prompt_tokens)
        self._buckets[b][key] = _Entry(item, key, b, now, next(self._order))
        self._where[key] = b
        return True

    def requeue(self, item: Any, prompt_tokens: int, arrival: float, key: Hashable | None = None) -> None:
        """Puts back a request that was popped but could not run (its replica failed before it streamed
        anything), with its original arrival time: ahead of every later arrival in its bucket, and aged
        from when it first came. Never refused: the request was accepted once already.
        """
        key = item if key is None else key
        if key in self._where:
            raise ValueError(f"{key!r} is already queued")
        b = self.bucket_of(prompt_tokens)
        bucket = self._buckets[b]
        entry = _Entry(item, key, b, arrival, next(self._order))
        later = [e for e in bucket.values() if e.arrival > arrival]  # rare: failover only, O(bucket)
        for e in later:
            del bucket[e.key]
        bucket[key] = entry
        for e in later:
            bucket[e.key] = e
        self._where[key] = b

    def pop(self, now: float) -> Any | None:
        """Removes and returns the request to admit next, or None when none waits.

        Each bucket's head is its oldest entry, so the oldest request overall is the oldest head: if it
        has waited longer than max_wait_s it goes first (and no other can be more overdue); otherwise
        the head of the shortest non-empty bucket goes.
        """
        heads = [next(iter(q.values())) for q in self._buckets if q]
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
        b = self._where.pop(key, None)
        if b is None:
            return None
        return self._buckets[b].pop(key).item

    def stats(self, now: float) -> list[BucketStats]:
        """Per bucket, shortest first: how many wait and for how long the oldest has."""
        out = []
        for (lower, upper), q in zip(self._bounds, self._buckets, strict=True):
            oldest = max(0.0, now - next(iter(q.values())).arrival) if q else 0.0
            out.append(BucketStats(bucket_name(lower, upper), lower, upper, len(q), oldest))
        return out

    def _take(self, entry: _Entry) -> None:
        del self._buckets[entry.bucket][entry.key]
        del self._where[entry.key]


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
