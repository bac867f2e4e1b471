"""Who comes into the batch (the Scheduler, scheduler/scheduler.py, inherits it): waiting sequences in
admission order (slack.py, within max_loras) once ready (grammar compiled, adapter loaded, fork's prompt
computed), each with its longest cached prefix or its first choice's prompt blocks; static batches that
start full or when their oldest has waited enough (and the static fallback's switch between modes);
min_batch_size's wait; and the admission window, how many requests the routers may send now. Plain
Python, no gRPC, no torch.
"""

from __future__ import annotations

from scheduler import forks, lora_slots, pooling, priority
from scheduler.plan import SchedulerOutput
from scheduler.policy import BATCHING_MODES
from scheduler.sequence import SequenceStatus
from scheduler.slack import admission_order


class Admission:
    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> None:
        static = self.batching == "static"
        if static and not self._static_batch:
            # A new static batch starts only when full, or when its oldest request has waited enough.
            oldest = self.waiting[0].arrival_time if self.waiting else None
            deadline = None if oldest is None else oldest + self.policy.static_batch_timeout_ms / 1000
            if len(self.waiting) < self.policy.static_batch_size and deadline is not None and now < deadline:
                out.wake_at = deadline
                return
            self._static_batch = {s.seq_id for s in list(self.waiting)[: self.policy.static_batch_size]}

        for seq in self._candidates(now):
            if budget <= 0 or len(self.running) >= self.policy.max_num_seqs:
                break
            if static and seq.seq_id not in self._static_batch:
                break
            # A waiting sequence holds no blocks and has computed nothing: a choice forked from another
            # shares that one's computed prompt blocks; otherwise its longest cached prefix (whole blocks,
            # never its last token) is reused; only the rest is computed.
            shared = forks.share(seq, self.blocks)
            num_cached = shared or (self.blocks.match_prefix(seq) if pooling.may_reuse(seq) else 0)
            num_new = self._chunk(seq, num_cached, budget)
            reserve = self._watermark_blocks if self.running else 0
            from_cache = num_cached - shared
            if not num_new or not self.blocks.can_allocate(seq, num_cached + num_new, reserve, from_cache):
                if shared:
                    self.blocks.free(seq)
                break  # first come, first served: nobody jumps the queue
            first = not seq.admitted_before
            self.blocks.allocate(seq, num_cached + num_new, num_cached_tokens=from_cache, count_query=first)
            seq.num_computed_tokens = num_cached
            if first:  # Usage.cached_tokens: what the client's request found, not a recompute
                seq.num_cached_tokens = from_cache
                out.first_admitted.append(seq)
            seq.admitted_before = True
            forks.unfork(seq)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            priority.insert(self.running, seq)
            out.admitted.append(seq)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

    def _candidates(self, now: float):
        """The waiting in admission order (slack.py, lora_slots.py), but those not ready (grammar, adapter,
        fork)."""
        size = self.blocks.block_size
        ready = [s for s in self.waiting if s.grammar_ready and s.adapter_ready and not forks.waits(s, size)]
        order = admission_order(ready, now, self.step_s, self.policy.max_num_batched_tokens)
        return lora_slots.within_max_loras(order, self.running, self.policy.max_loras)

    def batch_wait_deadline(
        self, now: float, queued: int, admission_depth: int | None = None
    ) -> float | None:
        """min_batch_size: the time until which to wait before a batch starts from nothing, None: step
        now (scheduler/batch_wait.py)."""
        return self._batch_wait.deadline(self, now, queued, admission_depth)

    def admission_window(self, depth: int, best_priority: int | None = None) -> int:
        """How many more requests to take in now: enough to fill the free slots of the batch (and the
        places of running sequences of lower priority than best_priority, the best a router queues), but
        no more than `depth` waiting here, so the router's queue (and its order) holds the rest."""
        if self.batching == "static":
            slots = 0 if self._static_batch else self.policy.static_batch_size
        else:
            slots = self.policy.max_num_seqs - len(self.running) - len(self.swapped)
            slots += priority.preemptible(self.running, best_priority)
        return max(0, min(slots, depth) - len(self.waiting))

    def set_batching(self, mode: str) -> None:
        """Switches continuous <-> static at run time (the static fallback). Switching to static makes
        the running sequences the current batch: nothing joins until it drains."""
        if mode not in BATCHING_MODES:
            raise ValueError(f"batching must be 'continuous' or 'static', got {mode!r}")
        self.batching = mode
        self._static_batch = {s.seq_id for s in self.running} if mode == "static" else set()
