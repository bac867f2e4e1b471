"""min_batch_size with batch_wait_timeout_ms: a batch that would start from nothing waits a little for
requests the router already holds for this scheduler (Scheduler.batch_wait_deadline).

Plain Python: it reads the scheduler's queues and policy, and keeps only when the current wait began.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


class BatchWait:
    def __init__(self) -> None:
        self.since: float | None = None  # when the current wait began; None: not waiting

    def deadline(
        self, sched: Scheduler, now: float, queued: int, admission_depth: int | None = None
    ) -> float | None:
        """Before a batch starts from nothing, the time until which to wait for requests the router holds
        (`queued`) that this scheduler would take now (None: step now). Never delays running or swapped
        sequences, never waits for requests it would grant no credit to or for more than can join
        (max_num_seqs, the admission depth), and at most batch_wait_timeout_ms a batch."""
        p = sched.policy
        target = min(p.min_batch_size, p.max_num_seqs, admission_depth or p.max_num_seqs)
        depth = admission_depth or p.max_num_seqs
        joinable = min(queued, sched.admission_window(depth))
        if (
            p.batch_wait_timeout_ms <= 0
            or sched.running
            or sched.swapped
            or not sched.waiting
            or len(sched.waiting) >= target
            or joinable == 0
        ):
            self.since = None
            return None
        if self.since is None:
            self.since = now
        deadline = self.since + p.batch_wait_timeout_ms / 1000
        return deadline if now < deadline else None
