"""Which model replica a request goes to: load-aware routing, prefix affinity, marking down and up.

The router holds one link per replica (one scheduler and its shard workers). Each scheduler reports its
load on its stream (`ReplicaLoad`, common/load.py); `ReplicaSet` keeps the last report of each and picks
a replica per request. Plain Python, no gRPC and no asyncio: the clock is an argument (`now`, from
time.monotonic(), never going backwards), so the policy is tested without sleeping or processes.

Headroom, in shares of one replica's capacity (1.0: an idle replica; below 0: work queues there):

    headroom = min(1 - running / max_num_seqs, kv_blocks_free / kv_blocks_total)
               - (waiting + swapped + pending) / max_num_seqs
               - step_seconds / slow_step_s

- The first term is what a new request could start in right now: a free sequence slot and free KV, so
  the scarcer of the two binds. A replica with free slots but a KV cache full of long sequences would
  preempt, one with free KV but no slot would queue; either way it has no room.
- Requests waiting there or swapped out there (and `pending`: those the router sent since the report,
  which the report does not count yet) each take a slot before the new request does, so each costs
  one slot's share.
- A slow recent step means every token there streams slowly (long prefills in the batch, a slower or
  degraded device, swapping), which the counts do not show. slow_step_s is the step time at which a
  replica counts as full: a 1 s step is one token a second per sequence, past any interactive use.
- Subtracting keeps the score monotonic in every input (a ratio would reward a slow replica when the
  counts are negative), and comparable across replicas of different max_num_seqs or KV sizes.

Short requests (prompt below short_edge, the router's short bucket) go to the least-loaded replica, as
in the seed: they need little KV and finish fast, so what delays them is the number of sequences ahead,
and their score is `1 - (running + waiting + swapped + pending) / max_num_seqs - step_seconds /
slow_step_s`, which ignores KV. It equals the headroom above whenever KV is not the scarcer resource.
Long requests use the headroom, because they need KV and a replica short of it would preempt for them.

Ties (within 1e-9) go round-robin in replica-id order, and every choice adds one to the chosen replica's
`pending` until its next report, so a burst that arrives before any report changes spreads over the
replicas (in proportion to their capacity) instead of landing on the one that looked best.

Integration: the link feeds `report` with every load report and `mark_down` when its stream breaks; a
timer calls `expire`; the router calls `choose` per request and, when a replica fails, `may_resend` for
each request it had (queue it again, resumed where it stopped, while it has attempts left).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass

from common.load import ReplicaLoad
from common.settings import setting

_TIE = 1e-9


def headroom(load: ReplicaLoad, pending: int, slow_step_s: float) -> float:
    """The long-request score (see the module docstring): higher is emptier, 1.0 at most."""
    kv_free = load.kv_blocks_free / load.kv_blocks_total if load.kv_blocks_total else 0.0
    room = min(1.0 - load.running / load.max_num_seqs, kv_free)
    ahead = load.waiting + load.swapped + pending
    return room - ahead / load.max_num_seqs - load.step_seconds / slow_step_s


def slot_headroom(load: ReplicaLoad, pending: int, slow_step_s: float) -> float:
    """The short-request score: sequences ahead and step time only (short prompts need little KV)."""
    ahead = load.running + load.waiting + load.swapped + pending
    return 1.0 - ahead / load.max_num_seqs - load.step_seconds / slow_step_s


@dataclass(frozen=True)
class RoutingPolicy:
    """The routing knobs; one per router, built from the command line."""

    # Prompts shorter than this go to the least-loaded replica: the router sets it to its short bucket.
    short_edge: int = 512
    stale_after_s: float = setting(
        3.0,
        flag="--replica-stale-s",
        help="a replica that sends no load report for this long is down and its requests move (a "
        "scheduler reports at least twice a second, see LoadReport)",
        launch=True,
    )
    slow_step_s: float = 1.0  # a replica whose recent step takes this long counts as full
    prefix_affinity: bool = setting(
        False,
        help="send requests sharing a prompt prefix to the replica that served it (its prefix cache)",
        launch=True,
    )
    # Stay on the replica that served a prefix unless its load (1 - headroom) exceeds
    # affinity_factor * the best replica's load + affinity_slack. The slack keeps affinity when the best
    # is idle and the affine one only lightly used (a pure ratio would move off 0.05 vs 0.0); the factor
    # lets it grow with load, where queueing costs more than the prefill a cache hit saves.
    affinity_factor: float = 2.0
    affinity_slack: float = 0.25
    affinity_capacity: int = 10_000  # prefixes remembered (least recently used dropped first)
    max_attempts: int = setting(
        3,
        flag="--max-request-attempts",
        help="schedulers a request may run on when the one running it is lost (it resumes where it stopped); "
        "a request that itself crashes schedulers must not take every replica down in turn",
        launch=True,
    )

    def __post_init__(self):
        def positive_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

        def positive_finite(name, minimum_inclusive=False):
            v = getattr(self, name)
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v < 0 or (v == 0 and not minimum_inclusive):
                bound = ">= 0" if minimum_inclusive else "> 0"
                raise ValueError(f"{name} must be a finite number {bound}, got {v!r}")

        positive_int("short_edge")
        positive_int("affinity_capacity")
        positive_int("max_attempts")
        positive_finite("stale_after_s")
        positive_finite("slow_step_s")
        positive_finite("affinity_slack", minimum_inclusive=True)
        positive_finite("affinity_factor")
        if self.affinity_factor < 1:
            raise ValueError(f"affinity_factor must be >= 1, got {self.affinity_factor!r}")


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's state, for GetStats and metrics (label: replica=id)."""

    replica: str
    up: bool
    reason: str  # why it is down ("no report yet", "stale", "stream broke", "shards not ready"); "" when up
    report_age_s: float  # since its last report; inf when it never reported
    load: ReplicaLoad | None  # its last report
    pending: int  # requests sent since that report that it does not count yet
    headroom: float  # the long-request score now; -inf when down
    routed_total: int  # requests routed to it since it was added (failover resends included)


@dataclass
class _Replica:
    load: ReplicaLoad | None = None
    reported_at: float = -math.inf
    pending: int = 0
    # Set by mark_down and expire (the stream is gone or given up on); cleared by any report. Shards not
    # ready is not a lost stream: the scheduler keeps its requests and recomputes them when they return.
    lost: str | None = "no report yet"
    routed_total: int = 0


@dataclass
class Routed:
    """A request in flight, for failover: where it went and whether a token has reached the client."""

    replica: str
    prompt_tokens: int
    prefix_key: Hashable | None = None
    attempts: int = 1  # replicas it has been sent to


class ReplicaSet:
    """The replicas behind the router: their last load reports, up/down state, and the choice per request.

    A replica is up when its last report is fresher than stale_after_s, said shards_ready, and it has not
    been marked down since. It is never chosen otherwise.
    """

    def __init__(self, policy: RoutingPolicy = RoutingPolicy(), replicas: Iterable[str] = ()):
        self.policy = policy
        self._replicas: dict[str, _Replica] = {}
        self._affinity: OrderedDict[Hashable, str] = OrderedDict()  # prefix key -> replica, LRU order
        self._last_choice: str | None = None  # the round-robin cursor among tied replicas
        self.affinity_hits = 0  # requests sent to the replica that served their prefix
        self.affinity_moves = 0  # prefixes moved because their replica was down or much busier
        for r in replicas:
            self.add(r)

    # Membership (--scheduler flags, or DNS re-resolution of a headless Service).

    def add(self, replica: str) -> None:
        """A new replica: down until its first ready report. Adding a known one changes nothing."""
        self._replicas.setdefault(replica, _Replica())

    def remove(self, replica: str) -> None:
        """Forgets a replica (gone from DNS). Prefixes that pointed to it move on their next request."""
        self._replicas.pop(replica, None)
        if self._last_choice == replica:
            self._last_choice = None

    def __contains__(self, replica: str) -> bool:
        return replica in self._replicas

    def ids(self) -> list[str]:
        return sorted(self._replicas)

    # State from the streams.

    def report(self, replica: str, load: ReplicaLoad, now: float, in_transit: int = 0) -> None:
        """A load report from replica's scheduler; a ready one brings the replica (back) up.

        in_transit: requests the router has routed to this replica that the report does not count yet
        (in the link's queue, or sent after the scheduler computed the report); it replaces the count of
        choices made since the previous report. With the report riding on the message that carries the
        scheduler's Credit, in_transit = (requests in the link's queue for it) + credits.sent -
        credit.adds_received, exact; left at 0, requests sent just before a report are missed until the
        next one (a small, self-correcting undercount).
        """
        r = self._replicas[replica]
        if isinstance(in_transit, bool) or not isinstance(in_transit, int) or in_transit < 0:
            raise ValueError(f"in_transit must be an integer >= 0, got {in_transit!r}")
        r.load, r.reported_at, r.pending, r.lost = load, now, in_transit, None

    def mark_down(self, replica: str, now: float, reason: str = "stream broke") -> None:
        """The replica's stream broke (or the link gave up on it): down until its next ready report."""
        r = self._replicas.get(replica)
        if r is not None:
            r.lost = reason
            r.pending = 0  # the scheduler dropped this router's requests with the stream

    def expire(self, now: float) -> list[str]:
        """Marks down every replica still connected (up, or waiting for its shards) whose last report is
        older than stale_after_s; returns them.

        The router calls this periodically (every second or so) and treats each returned replica like a
        broken stream: cancel the stream, fail over its requests. choose() never picks a stale replica
        even between calls.
        """
        gone = [
            rid
            for rid in self.ids()
            if self._replicas[rid].lost is None and self._stale(self._replicas[rid], now)
        ]
        for rid in gone:
            self.mark_down(rid, now, "stale")
        return gone

    def is_up(self, replica: str, now: float) -> bool:
        r = self._replicas.get(replica)
        return r is not None and self._down_reason(r, now) == ""

    def _down_reason(self, r: _Replica, now: float) -> str:
        if r.lost is not None:
            return r.lost
        if self._stale(r, now):
            return "stale"
        return "" if r.load.shards_ready else "shards not ready"

    def healthy(self, now: float) -> bool:
        """At least one replica is up: the router's health is SERVING."""
        return any(self.is_up(rid, now) for rid in self._replicas)

    def _stale(self, r: _Replica, now: float) -> bool:
        return now - r.reported_at > self.policy.stale_after_s

    # The choice.

    def choose(
        self,
        prompt_tokens: int,
        prefix_key: Hashable | None = None,
        *,
        now: float,
        allowed: Collection[str] | None = None,
    ) -> str | None:
        """The replica for a new request, or None when none is up (the router answers UNAVAILABLE).

        prefix_key: with prefix_affinity on, identifies the prompt's prefix (the caller hashes the first
        N tokens, N a multiple of the KV block size so the scheduler's prefix cache can hit; None for
        prompts shorter than N). allowed: consider only these replicas (e.g. those with admission credit
        when the router binds requests to replicas as credit arrives, or all but the one that failed).

        The chosen replica's pending count goes up by one until its next report.
        """
        cands = [rid for rid in self.ids() if self.is_up(rid, now) and (allowed is None or rid in allowed)]
        if not cands:
            return None
        score = slot_headroom if prompt_tokens < self.policy.short_edge else headroom
        scores = {
            rid: score(self._replicas[rid].load, self._replicas[rid].pending, self.policy.slow_step_s)
            for rid in cands
        }
        best = self._best(cands, scores)
        chosen = best
        if self.policy.prefix_affinity and prefix_key is not None:
            chosen = self._affine(prefix_key, best, scores)
        if chosen == best:
            self._last_choice = best  # affinity does not move the round-robin cursor
        r = self._replicas[chosen]
        r.pending += 1
        r.routed_total += 1
        return chosen

    def _best(self, cands: list[str], scores: dict[str, float]) -> str:
        """Highest score; among ties, the first id after the last choice (round-robin), wrapping."""
        top = max(scores.values())
        tied = [rid for rid in cands if scores[rid] >= top - _TIE]  # cands are sorted by id
        if self._last_choice is not None:
            for rid in tied:
                if rid > self._last_choice:
                    return rid
        return tied[0]

    def _affine(self, key: Hashable, best: str, scores: dict[str, float]) -> str:
        """The replica that last served key unless it is unavailable or much busier than best; records
        the result as key's replica (most recently used)."""
        p = self.policy
        prev = self._affinity.get(key)
        chosen = best
        if prev is not None and prev in scores:
            load_prev, load_best = 1.0 - scores[prev], 1.0 - scores[best]
            if load_prev <= p.affinity_factor * load_best + p.affinity_slack:
                chosen = prev
        if prev is not None:
            if chosen == prev:
                self.affinity_hits += 1
            else:
                self.affinity_moves += 1
        self._affinity[key] = chosen
        self._affinity.move_to_end(key)
        while len(self._affinity) > p.affinity_capacity:
            self._affinity.popitem(last=False)
        return chosen

    # Failover.

    def may_resend(self, req: Routed) -> bool:
        """Whether a request on a lost replica may run again (elsewhere, or on the restarted scheduler):
        while it has attempts left, since it may itself be what crashes schedulers. One that streamed
        tokens resumes where it stopped (the router holds them). The others end with UNAVAILABLE."""
        return req.attempts < self.policy.max_attempts

    # Observability.

    def stats(self, now: float) -> list[ReplicaStats]:
        """Per replica, by id: for GetStats and the per-replica metrics."""
        out = []
        for rid in self.ids():
            r = self._replicas[rid]
            reason = self._down_reason(r, now)
            up = reason == ""
            h = headroom(r.load, r.pending, self.policy.slow_step_s) if up and r.load else -math.inf
            out.append(
                ReplicaStats(rid, up, reason, now - r.reported_at, r.load, r.pending, h, r.routed_total)
            )
        return out
