"""The clock of requests while the ranks are lost (the engine's second task, beside the step loop).

A request still waiting worker_recovery_timeout_s after the loss, or after its own arrival if later,
ends with UNAVAILABLE (its router may send it elsewhere): none waits forever, none is dropped silently.
The engine sets `_lost_at` when the ranks are lost (None again after a good step) and wakes this task
through `_expiry_wakeup` (a loss, or a request arriving during one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_UNAVAILABLE

log = logging.getLogger("tpserve.scheduler")


async def expire_while_lost(engine) -> None:
    """Runs for the engine's life: fails each request due, then sleeps until the next one is."""
    timeout = engine.config.worker_recovery_timeout_s
    while True:
        deadline = None
        if engine._lost_at is not None and engine.scheduler is not None:
            now = time.monotonic()
            due = []
            for seq in engine.scheduler.sequences():
                expires = max(engine._lost_at, seq.arrival_time) + timeout
                if expires <= now:
                    due.append(seq.request_id)
                else:
                    deadline = expires if deadline is None else min(deadline, expires)
            if due:
                log.error("shard workers still lost after %.0fs: failing %d request(s)", timeout, len(due))
                message = "a shard worker was lost and did not return in time"
                engine._fail(due, ERROR_CODE_UNAVAILABLE, message)
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        engine._expiry_wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(engine._expiry_wakeup.wait(), wait)
