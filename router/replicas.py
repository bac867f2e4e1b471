"""Which model replica a request goes to: by what each has cached and by load; marking down and up.

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

Cache-aware (--routing-policy cache_aware, the default): each replica's KV events keep the router's
index of the block hashes it caches (router/cache_index.py), and a request's score there is its load
score plus

    cache_weight * (device_tokens + host_cache_weight * host_tokens) / prompt_tokens

where device_tokens + host_tokens are the tokens of the prompt's longest prefix the replica holds (whole
blocks, never the last token, the scheduler's own rule; none for a request that wants prompt logprobs,
which the scheduler never serves from the cache), host_tokens those only its host tier holds. A host
block is copied back to the device before the step, not recomputed: cheaper than a prefill (a PCIe copy
of the block's KV against the block's FLOPs) but not free, hence host_cache_weight (0.8) < 1.
A full hit is worth cache_weight of a replica's capacity (0.5: half of max_num_seqs more sequences
ahead, or half its KV): the prefill it saves against the queueing it costs, so a request goes where
its prefix is unless that replica is that much busier. least_loaded is the load score alone;
round_robin ignores load (and the cache) and takes the replicas in turn.

Ties (within 1e-9) go round-robin in replica-id order, and every choice adds one to the chosen replica's
`pending` until its next report, so a burst that arrives before any report changes spreads over the
replicas (in proportion to their capacity) instead of landing on the one that looked best.

Integration: the link feeds `report` with every load report, `kv_events` with every batch of KV events and
`mark_down` when its stream breaks (the replica's index is dropped with it); a timer calls `expire`; the
router calls `choose` per request and, when a replica fails, `may_resend` for each request it had (queue it
again, resumed where it stopped, while it has attempts left).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from common.kv_events import KvEvents
from common.load import ReplicaLoad
from common.settings import setting
from router.cache_index import DEVICE, CacheIndex

ROUTING_POLICIES = ("cache_aware", "least_loaded", "round_robin")

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
    routing_policy: str = setting(
        "cache_aware",
        help="how a replica is chosen: cache_aware (the prefix each replica holds, from its KV events, "
        "against its load), least_loaded, or round_robin",
        choices=ROUTING_POLICIES,
        launch=True,
    )
    cache_weight: float = setting(
        0.5,
        flag="--routing-cache-weight",
        help="cache_aware: what a request whose whole prompt is cached on a replica is worth there, in "
        "shares of that replica's capacity (its load score is 1.0 idle, 0.0 full)",
        launch=True,
    )
    host_cache_weight: float = setting(
        0.8,
        flag="--routing-host-cache-weight",
        help="cache_aware: what a prompt block a replica holds only in its host tier (--host-prefix-cache) "
        "is worth against one on its device (1.0: the same)",
        launch=True,
    )
    cache_index_blocks: int = setting(
        1 << 20,
        flag="--routing-cache-index-blocks",
        help="cache_aware: block hashes the router keeps per replica (about 100 bytes each); past it the "
        "oldest are forgotten and counted",
        launch=True,
    )
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
        positive_int("cache_index_blocks")
        positive_int("max_attempts")
        positive_finite("stale_after_s")
        positive_finite("slow_step_s")
        positive_finite("cache_weight", minimum_inclusive=True)
        positive_finite("host_cache_weight", minimum_inclusive=True)
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}")


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
    cache_hit_tokens_total: int = 0  # of the prompts routed to it, tokens its cache held when chosen
    cached_blocks: int = 0  # block hashes the router's index holds for it
    index_dropped_total: int = 0  # hashes the index forgot for lack of room (cache_index_blocks)


@dataclass
class _Replica:
    load: ReplicaLoad | None = None
    reported_at: float = -math.inf
    pending: int = 0
    # Set by mark_down and expire (the stream is gone or given up on); cleared by any report. Shards not
    # ready is not a lost stream: the scheduler keeps its requests and recomputes them when they return.
    lost: str | None = "no report yet"
    routed_total: int = 0
    index: CacheIndex | None = None  # what its prefix cache holds (its KV events)
    cache_hit_tokens_total: int = 0


@dataclass
class Routed:
    """A request in flight, for failover: where it went and whether a token has reached the client."""

    replica: str
    prompt_tokens: int
    attempts: int = 1  # replicas it has been sent to


class ReplicaSet:
    """The replicas behind the router: their last load reports, up/down state, and the choice per request.

    A replica is up when its last report is fresher than stale_after_s, said shards_ready, and it has not
    been marked down since. It is never chosen otherwise.
    """

    def __init__(self, policy: RoutingPolicy = RoutingPolicy(), replicas: Iterable[str] = ()):
        self.policy = policy
        self._replicas: dict[str, _Replica] = {}
        self._last_choice: str | None = None  # the round-robin cursor among tied replicas
        for r in replicas:
            self.add(r)

    # Membership (--scheduler flags, or DNS re-resolution of a headless Service).

    def add(self, replica: str) -> None:
        """A new replica: down until its first ready report. Adding a known one changes nothing."""
        self._replicas.setdefault(replica, _Replica(index=CacheIndex(self.policy.cache_index_blocks)))

    def remove(self, replica: str) -> None:
        """Forgets a replica (gone from DNS), its cache index with it."""
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

    def kv_events(self, replica: str, events: KvEvents) -> None:
        """A batch of the replica's prefix-cache events (a snapshot first thing on each stream)."""
        r = self._replicas.get(replica)
        if r is not None:
            r.index.apply(events)

    def cached_hashes(self, replica: str, tier: int = DEVICE) -> set[bytes]:
        """The hashes the router believes replica caches in this tier (router/cache_index.py)."""
        return self._replicas[replica].index.hashes(tier)

    def mark_down(self, replica: str, now: float, reason: str = "stream broke") -> None:
        """The replica's stream broke (or the link gave up on it): down until its next ready report. Its
        cache index is dropped: it may have restarted empty, and its next stream starts with a
        snapshot."""
        r = self._replicas.get(replica)
        if r is not None:
            r.lost = reason
            r.pending = 0  # the scheduler dropped this router's requests with the stream
            r.index.clear()

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
        block_hashes: Sequence[bytes] = (),
        *,
        now: float,
        allowed: Collection[str] | None = None,
        block_size: int = 16,
    ) -> str | None:
        """The replica for a new request, or None when none is up (the router answers UNAVAILABLE).

        block_hashes: the chained hashes of the prompt's blocks that a prefix cache may serve
        (common/block_hash.py: whole blocks, never the last token; empty when none may, e.g. prompt
        logprobs), of block_size tokens each. allowed: consider only these replicas (e.g. those with
        admission credit, or all but the one that failed).

        The chosen replica's pending count goes up by one until its next report.
        """
        cands = [rid for rid in self.ids() if self.is_up(rid, now) and (allowed is None or rid in allowed)]
        if not cands:
            return None
        p = self.policy
        hits = dict.fromkeys(cands, 0)
        if p.routing_policy == "round_robin":
            scores = dict.fromkeys(cands, 0.0)
        else:
            score = slot_headroom if prompt_tokens < p.short_edge else headroom
            scores = {
                rid: score(self._replicas[rid].load, self._replicas[rid].pending, p.slow_step_s)
                for rid in cands
            }
        if p.routing_policy == "cache_aware" and block_hashes and prompt_tokens > 0:
            for rid in cands:
                device, host = self._replicas[rid].index.match(block_hashes)
                hits[rid] = (device + host) * block_size
                worth = (device + p.host_cache_weight * host) * block_size
                scores[rid] += p.cache_weight * worth / prompt_tokens
        chosen = self._best(cands, scores)
        self._last_choice = chosen
        r = self._replicas[chosen]
        r.pending += 1
        r.routed_total += 1
        r.cache_hit_tokens_total += hits[chosen]
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
                ReplicaStats(
                    rid,
                    up,
                    reason,
                    now - r.reported_at,
                    r.load,
                    r.pending,
                    h,
                    r.routed_total,
                    r.cache_hit_tokens_total,
                    len(r.index),
                    r.index.dropped,
                )
            )
        return out
