"""The replicas behind the router: one link each, one shared admission queue, the choice and failover.

Requests wait in ONE length-bucketed AdmissionQueue (router/buckets.py: higher priority first, then short
first, aged ones never starved, a bound answered with RESOURCE_EXHAUSTED). A request is bound to a replica
only when it leaves the queue: whenever some replica has credit, the next request is popped and
ReplicaSet.choose picks among the replicas that have credit (router/replicas.py: the prefix each replica
caches, known exactly from its KV events, against its load). So a busy replica never holds requests an
idle one could start.

Failover and resume, when a replica's stream breaks or its reports stop, are router/failover.py's. Which
replicas exist is router/membership.py's; GetStats across them is router/stats.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from common import security
from common.kv_events import KvEvents
from common.load import ReplicaLoad
from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_UNAVAILABLE
from common.pb.tpserve.v1 import generation_pb2
from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_ABORTED
from router.buckets import AdmissionQueue
from router.failover import Failover
from router.in_flight import InFlight
from router.membership import Membership, Resolver, resolve_dns
from router.replicas import ReplicaSet, Routed, RoutingPolicy
from router.scheduler_link import QueueFull, SchedulerLink, SchedulerUnavailable
from router.slo import NO_OBJECTIVES, Objectives, SloEstimator, ttft_budget_ms
from router.stats import gather_stats

log = logging.getLogger("tpserve.router")


class SchedulerPool(Failover):
    def __init__(
        self,
        admission: AdmissionQueue,
        policy: RoutingPolicy,
        on_ready: Callable[[bool], None],
        *,
        schedulers: tuple[str, ...] = (),
        dns: str | None = None,  # NAME:PORT, re-resolved every dns_interval_s
        resolver: Resolver = resolve_dns,
        dns_interval_s: float = 5.0,
        retry_s: float = 0.5,
        check_s: float = 0.5,
        replica_wait_timeout_s: float = 60.0,
        tls: security.TlsFiles | None = None,
        slo: SloEstimator | None = None,
    ):
        self.admission = admission
        self.slo = slo or SloEstimator()  # latency objectives: the admission estimate, decode gating
        self.replicas = ReplicaSet(policy)
        self.on_ready = on_ready
        self.on_admit = lambda add, waited_s: None  # the servicer's metrics hook
        self.on_failover = lambda replica, resent, failed: None
        self.on_resume = lambda request_id: None  # a request that had streamed goes on elsewhere
        self.on_link_connected = lambda link: None  # a replica's stream (re)connected (router/lora.py)
        self.membership = Membership(
            self._add,
            self._remove,
            schedulers=schedulers,
            dns=dns,
            resolver=resolver,
            interval_s=dns_interval_s,
        )
        self._retry_s = retry_s
        self._check_s = check_s
        self._tls = tls
        self.links: dict[str, SchedulerLink] = {}
        self._requests: dict[str, InFlight] = {}
        self._ready = False
        # While no replica is ready, queued requests wait this long (like the schedulers' own recovery
        # timeout) and then get UNAVAILABLE: every accepted request ends, even if no replica returns.
        self._unready_since: float | None = None
        self._queued_timeout_s = replica_wait_timeout_s
        self._tasks: list[asyncio.Task] = []

    # ---- membership ----

    async def start(self) -> None:
        await self.membership.start()
        self._tasks.append(asyncio.create_task(self._check_forever()))

    async def close(self) -> None:
        self.membership.stop()
        for t in self._tasks:
            t.cancel()
        for link in list(self.links.values()):
            await link.close()

    def _add(self, target: str) -> None:
        link = SchedulerLink(target, self, self._retry_s, self._tls, self.membership.server_name)
        self.links[target] = link
        self.replicas.add(target)
        link.start()
        log.info("replica %s added", target)

    async def _remove(self, target: str) -> None:
        link = self.links.pop(target, None)
        if link is None:
            return
        self._fail_over(target, "removed")
        self.replicas.remove(target)
        await link.close()
        self._update_health()

    # ---- what the servicer calls ----

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def model_info(self) -> generation_pb2.ModelInfo | None:
        """The model as the replicas describe it; the smallest max_model_len (a request may run on any)."""
        infos = [link.model_info for link in self.links.values() if link.model_info is not None]
        return min(infos, key=lambda i: i.max_model_len) if infos else None

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def accepting(self) -> bool:
        """Whether new requests are taken: a replica is up, or one was (the model is known) and the wait
        for one to come back has not run out. Requests taken meanwhile wait in the queue."""
        if self._ready:
            return True
        if self.model_info is None or self._unready_since is None:
            return False
        return time.monotonic() - self._unready_since < self._queued_timeout_s

    def submit(self, add: scheduler_pb2.AddRequest, objectives: Objectives = NO_OBJECTIVES) -> asyncio.Queue:
        """Queues the request; its outputs come on the returned queue. SloRefused, TpotInfeasible: slo.py."""
        if not self.accepting:
            raise SchedulerUnavailable("no replica is ready")
        now = time.monotonic()
        # Its TTFT behind those that leave the queue first; SloRefused when that misses its objective.
        ahead = self.admission.ahead(len(add.prompt_token_ids), add.priority)
        loads, pending = self._loads(now)
        self.slo.infeasible_tpot(objectives, loads)
        free = sum(
            self.links[t].credits.available
            for t in loads
            if t in self.links and self.slo.takes_decode(t, loads[t], pending.get(t, 0))
        )
        predicted = self.slo.check(objectives, loads, ahead, free)
        if not self.admission.push(
            add.request_id, len(add.prompt_token_ids), now, add.request_id, add.priority
        ):
            raise QueueFull(f"{len(self.admission)} requests are already waiting; try again later")
        req = InFlight(add, now, asyncio.Queue(), prompt=tuple(add.prompt_token_ids))
        req.objectives, req.predicted_ttft = objectives, predicted
        self._requests[add.request_id] = req
        self._pump()
        return req.queue

    def queued_on_adapter(self, lora_name: str) -> int:
        """Requests on a LoRA adapter waiting in the admission queue (not sent to a replica)."""
        return sum(1 for r in self._requests.values() if r.routed is None and r.add.lora_name == lora_name)

    def abort(self, request_id: str) -> None:
        """The router no longer wants request_id (finished by stop string, cancelled, disconnected)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if self.admission.remove(request_id) is not None:
            self._report_queued()
        elif req.routed is not None and req.routed.replica in self.links:
            self.links[req.routed.replica].abort(request_id)
        if req.routed is not None:
            self._left(req.routed.replica, request_id, None)

    async def drain(self, timeout_s: float) -> None:
        """Waits up to timeout_s for the requests in flight to end; the rest end ABORTED, KV freed."""
        deadline = time.monotonic() + timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._requests:
            log.warning("drain timeout: ending %d request(s) with FINISH_REASON_ABORTED", len(self._requests))
        for request_id, req in list(self._requests.items()):
            self.abort(request_id)
            req.queue.put_nowait(
                scheduler_pb2.RequestOutput(request_id=request_id, finish_reason=FINISH_REASON_ABORTED)
            )

    def done(self, request_id: str) -> None:
        """The request ended normally: stop routing to it."""
        req = self._requests.pop(request_id, None)
        if req is not None and req.routed is not None:
            self._left(req.routed.replica, request_id, None)

    def _left(
        self, replica: str, request_id: str, seconds: float | None, tokens: int = 0, now: float | None = None
    ) -> None:
        """A request left replica: its TPOT objective no longer holds the replica closed (slo.takes_decode),
        so what waits here is offered again (no credit message need follow: the window may not change)."""
        self.slo.ended(replica, request_id, seconds, tokens, now)
        if len(self.admission):
            self._pump()

    def _loads(self, now: float) -> tuple[dict[str, ReplicaLoad], dict[str, int]]:
        """The up replicas' last load reports, and the requests sent to each since its report."""
        up = [s for s in self.replicas.stats(now) if s.up and s.load is not None]
        return {s.replica: s.load for s in up}, {s.replica: s.pending for s in up}

    # ---- admission and the choice ----

    def _pump(self) -> None:
        """Sends queued requests while some replica has credit, each to the best replica with credit."""
        now = time.monotonic()
        while len(self.admission):
            loads, pending = self._loads(now)  # those stepping past their requests' TPOT objectives wait
            allowed = {
                t
                for t, link in self.links.items()
                if link.connected
                and link.credits.available > 0
                and self.slo.takes_decode(t, loads.get(t), pending.get(t, 0))
                and t in loads
            }
            if not allowed:
                break
            req = self._requests[self.admission.pop(now)]
            hashes, block_size = [], 16
            info = self.model_info
            if self.replicas.policy.routing_policy == "cache_aware" and info is not None:
                block_size = info.block_size
                hashes = req.block_hashes(block_size)
            target = self.replicas.choose(
                len(req.add.prompt_token_ids), hashes, now=now, allowed=allowed, block_size=block_size
            )
            link = self.links[target]
            link.credits.take()
            req.attempts += 1
            req.routed = Routed(target, len(req.add.prompt_token_ids), req.attempts)
            req.sent_at, req.first_seen = now, False
            self.slo.sent(target, req.add.request_id, req.objectives, len(req.prompt), req.add.max_new_tokens)
            req.add.ttft_budget_ms = ttft_budget_ms(req.objectives, now - req.arrival)  # the scheduler's
            self.on_admit(req.add, now - req.arrival)
            link.send(req.add)
        self._report_queued()

    def _report_queued(self) -> None:
        """Each replica is told its share of what waits here (any of them may get any of it)."""
        now = time.monotonic()
        up = [link for t, link in self.links.items() if self.replicas.is_up(t, now)]
        share = -(-len(self.admission) // max(1, len(up)))
        for link in up:
            link.report_queued(share, self.admission.best_priority())

    # ---- what the links report ----

    def on_connected(self, link: SchedulerLink) -> None:
        self.on_link_connected(link)
        info = self.model_info
        if info is not None and link.model_info is not None:
            mine = link.model_info
            if (mine.model_name, mine.vocab_size) != (info.model_name, info.vocab_size):
                log.error(
                    "replica %s serves %s (vocab %d), the others %s (vocab %d)",
                    link.target,
                    mine.model_name,
                    mine.vocab_size,
                    info.model_name,
                    info.vocab_size,
                )

    def on_load(self, link: SchedulerLink, msg: scheduler_pb2.LoadReport) -> None:
        if link.target not in self.replicas:
            return
        try:
            load = ReplicaLoad.from_message(msg)
        except ValueError as e:  # no scheduler sends one; the replica goes stale if it keeps on
            log.error("replica %s sent a load report that is not one: %s", link.target, e)
            return
        # Requests sent since the scheduler computed the report are not in it yet.
        in_transit = max(0, link.credits.sent - msg.adds_received)
        now = time.monotonic()
        was_up = self.replicas.is_up(link.target, now)
        self.replicas.report(link.target, load, now, in_transit=in_transit)
        self.slo.reported(link.target, load, now)
        if not was_up:
            self._update_health()
        if not was_up or len(self.admission):
            self._pump()  # up again, or a new step time may reopen it (slo.takes_decode)

    def on_kv_events(self, link: SchedulerLink, msg: scheduler_pb2.KvEvents) -> None:
        if link.target in self.replicas:
            self.replicas.kv_events(link.target, KvEvents.from_message(msg))

    def on_credit(self, link: SchedulerLink) -> None:
        self._pump()

    def on_output(self, link: SchedulerLink, out: scheduler_pb2.RequestOutput) -> None:
        req = self._requests.get(out.request_id)
        if req is None or req.routed is None or req.routed.replica != link.target:
            return  # aborted, or moved to another replica: whatever this one says is stale
        # The replica refused it or lost its shards for good: it goes on elsewhere, if it may.
        if out.error and out.error_code == ERROR_CODE_UNAVAILABLE:
            self._move(req, link.target, out.error)
            self._pump()
            return
        req.generated.extend(out.token_ids)
        req.queue.put_nowait(out)
        now = time.monotonic()
        if out.token_ids and not req.first_seen:
            req.first_seen = True
            self.slo.first_token(link.target, now - req.sent_at, out.request_id, now)
            if req.predicted_ttft and len(req.generated) == len(out.token_ids):  # not a resume
                self.slo.observed_ttft(req.predicted_ttft, now - req.arrival)
        elif out.token_ids and len(req.generated) % 8 == 0:  # its TPOT so far, every 8 tokens
            self.slo.progressed(link.target, out.request_id, len(req.generated), now)
        if out.finish_reason or out.error:
            self._requests.pop(out.request_id, None)
            seconds = None if out.error else now - req.sent_at
            self._left(link.target, out.request_id, seconds, len(req.generated), now)

    def on_lost(self, link: SchedulerLink, reason: str) -> None:
        if link.target not in self.replicas:
            return
        self.replicas.mark_down(link.target, time.monotonic(), reason)
        self._fail_over(link.target, reason)
        self._update_health()

    # ---- stats ----

    async def stats(self) -> generation_pb2.Stats:
        """Sums over the replicas whose scheduler answers, with one ReplicaStats each."""
        total = await gather_stats({t: link.stub for t, link in self.links.items()}, self.replicas)
        if total is None:
            raise SchedulerUnavailable("no scheduler answered")
        return total
