"""Failover and resume: what the router does when a replica goes away.

A replica whose stream breaks, or whose reports stop for stale_after_s (checked every
check_s; the scheduler reports at least every 0.5 s), is marked down and its stream dropped (the
scheduler then drops this router's requests, so none runs twice). Its requests go back to the queue with
their arrival time, to be sent elsewhere or to the restarted scheduler. A request that had streamed
tokens resumes: its prompt becomes the prompt plus every token the client received, marked as output
(AddRequest.num_output_tokens), so the new scheduler recomputes its KV and goes on with the same
max_new_tokens budget and, for seeded sampling, the same random stream (the worker's draw for output
position i depends only on (seed, i)); no token is sent twice. A request goes to at most
max_attempts schedulers (it may itself be what crashes them), then ends with UNAVAILABLE naming the
cap. Outputs that still arrive from a replica for a request that moved away are dropped. While no
replica is up, requests (new ones too, once the model is known) wait up to replica_wait_timeout_s for
one to come back, then get UNAVAILABLE. Health is SERVING while at least one replica is up.

SchedulerPool (router/pool.py) inherits it; what it reads of the pool: links, replicas, admission, slo,
the requests in flight, the health callbacks and _pump.
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_UNAVAILABLE
from router.in_flight import InFlight

log = logging.getLogger("tpserve.router")


class Failover:
    # ---- replicas that stop reporting ----

    async def _check_forever(self) -> None:
        """Replicas that stopped reporting are down (their stream is dropped); health follows."""
        while True:
            await asyncio.sleep(self._check_s)
            for target in self.replicas.expire(time.monotonic()):
                log.warning(
                    "replica %s sent no load report for %.1fs: dropping it",
                    target,
                    self.replicas.policy.stale_after_s,
                )
                self._fail_over(target, "stale")
                link = self.links.get(target)
                if link is not None:
                    link.drop()
            self._update_health()
            since = self._unready_since
            if (
                since is not None
                and len(self.admission)
                and time.monotonic() - since > self._queued_timeout_s
            ):
                self._fail_queued(f"no replica has been ready for {self._queued_timeout_s:.0f}s")

    def _move(self, req: InFlight, target: str, reason: str) -> str:
        """Takes a request off a replica that lost it: back in the queue (resumed where it stopped if it
        had streamed tokens) while it has attempts left, else it ends with UNAVAILABLE. Returns what
        happened: "resent", "resumed" or "failed"."""
        cap = self.replicas.policy.max_attempts
        if not self.replicas.may_resend(req.routed):
            self._requests.pop(req.add.request_id, None)
            self.slo.ended(target, req.add.request_id, None)
            req.queue.put_nowait(
                scheduler_pb2.RequestOutput(
                    request_id=req.add.request_id,
                    error=f"the request ran on {req.attempts} schedulers, the most one may "
                    f"(--max-request-attempts {cap}), and the last, {target}, lost it: {reason}",
                    error_code=ERROR_CODE_UNAVAILABLE,
                )
            )
            return "failed"
        outcome = "resent"
        if req.generated:
            req.add = req.resumed()
            outcome = "resumed"
            self.on_resume(req.add.request_id)
        self.slo.ended(target, req.add.request_id, None)
        req.routed = None
        self.admission.requeue(
            req.add.request_id, len(req.prompt), req.arrival, req.add.request_id, req.add.priority
        )
        return outcome

    def _fail_over(self, target: str, reason: str) -> None:
        """Replica target is gone: its requests go back to the queue, to run elsewhere or on the
        restarted scheduler (resumed where they stopped), within their attempts."""
        self._update_health()
        mine = [r for r in self._requests.values() if r.routed is not None and r.routed.replica == target]
        outcomes = [
            self._move(req, target, f"the replica was lost ({reason})")
            for req in sorted(mine, key=lambda r: r.arrival)
        ]
        if mine:
            failed = outcomes.count("failed")
            log.warning(
                "replica %s lost (%s): %d request(s) resumed, %d resent, %d failed",
                target,
                reason,
                outcomes.count("resumed"),
                outcomes.count("resent"),
                failed,
            )
            self.on_failover(target, len(mine) - failed, failed)
        self._pump()

    def _fail_queued(self, message: str) -> None:
        """No replica is up: queued requests fail rather than wait for one that may not come back."""
        while (request_id := self.admission.pop(float("inf"))) is not None:
            req = self._requests.pop(request_id, None)
            if req is not None:
                req.queue.put_nowait(
                    scheduler_pb2.RequestOutput(
                        request_id=request_id, error=message, error_code=ERROR_CODE_UNAVAILABLE
                    )
                )

    def _update_health(self) -> None:
        ready = self.model_info is not None and self.replicas.healthy(time.monotonic())
        if ready != self._ready:
            self._ready = ready
            self._unready_since = None if ready else time.monotonic()
            if ready:
                log.info("router serving")
            else:
                log.warning(
                    "router has no replica up: requests wait up to %.0fs for one", self._queued_timeout_s
                )
            self.on_ready(ready)
