"""Forms the batch of every model iteration (continuous batching), or whole batches (static mode).

No prefill phase and no decode phase: every sequence has num_computed_tokens catching up with its token
count, under a per-step token budget and a sequence cap. A prompt longer than what is left of the budget
is split across steps (chunked prefill). Running sequences are served by priority, then oldest first;
then swapped ones come back and waiting ones are admitted. Who comes in is scheduler/admission.py's;
who is preempted (swapped out or recomputed) and how it comes back is scheduler/preemption.py's. Here:
requests in and out, one iteration, its results (the stop checks, the one release path).
"""

from __future__ import annotations

from collections import deque

from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_ABORTED, FINISH_REASON_EOS, FINISH_REASON_LENGTH
from scheduler import forks, images, pooling, priority
from scheduler.admission import Admission
from scheduler.batch_wait import BatchWait
from scheduler.block_manager import BlockManager
from scheduler.plan import Proposer, ScheduledSeq, SchedulerOutput, SchedulerSnapshot, SequenceUpdate
from scheduler.policy import BATCHING_MODES, SchedulingPolicy
from scheduler.preemption import Preemption
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.swap import HostBlockPool

__all__ = ["BATCHING_MODES", "Scheduler", "SchedulingPolicy"]


class Scheduler(Admission, Preemption):
    def __init__(
        self,
        policy: SchedulingPolicy,
        block_manager: BlockManager,
        eos_token_ids=(),
        host_blocks: HostBlockPool | None = None,
        proposer: Proposer | None = None,
    ):
        if policy.max_model_len < 1:
            raise ValueError(
                "the policy's max_model_len must be resolved (the model's, capped) before scheduling"
            )
        self.policy = policy
        self.blocks = block_manager
        # Swap space on the ranks' hosts; None or empty: every preemption recomputes.
        self.host_blocks = host_blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.proposer = proposer
        self._speculating = False  # whether this step makes proposals (Proposer.enabled, per step)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by priority, then admission: the last is preempted first
        self.swapped: list[Sequence] = []  # by priority, then oldest (lowest seq_id): the first to come back
        self._by_request: dict[str, Sequence] = {}
        self._forgotten: list[int] = []
        self._static_batch: set[int] = set()  # static mode: the batch being served
        self._watermark_blocks = int(policy.admission_watermark * block_manager.num_blocks)
        self.num_preemptions = 0
        # The mode in force: the policy's, unless the static fallback switched it at run time.
        self.batching = policy.batching
        self._batch_wait = BatchWait()  # min_batch_size's wait for requests on their way
        self.step_s = 0.0  # the last step's time (the engine's): slack's prediction of a prefill

    # ---- requests in and out ----

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_request:
            raise KeyError(f"request {seq.request_id!r} is already in flight")
        if seq.num_prompt_tokens + seq.max_new_tokens > self.policy.max_model_len:
            raise ValueError(
                f"prompt ({seq.num_prompt_tokens}) + max_new_tokens ({seq.max_new_tokens}) "
                f"exceeds max_model_len ({self.policy.max_model_len})"
            )
        seq.status = SequenceStatus.WAITING
        self._by_request[seq.request_id] = seq
        self.waiting.append(seq)
        if seq.fork_of is not None:
            if seq.fork_of.is_finished or forks.share_point(seq.fork_of, self.blocks.block_size) == 0:
                seq.fork_of = None  # nothing to share
            else:
                seq.fork_of.forks_waiting += 1

    def abort(self, request_id: str) -> Sequence | None:
        """Drops a request wherever it is; its blocks are free at once. None if it is not in flight."""
        seq = self._by_request.get(request_id)
        if seq is not None:
            self.end(seq, FINISH_REASON_ABORTED)
        return seq

    def end(self, seq: Sequence, reason: int) -> None:
        """Ends seq wherever it is (waiting, swapped out or running) for this FinishReason."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, reason)

    def grammars_ready(self, seq_ids) -> None:
        """Rank 0 reports these sequences' grammars compiled: they may be admitted."""
        ready = set(seq_ids)
        for seq in self.waiting:
            if seq.seq_id in ready:
                seq.grammar_ready = True

    def sequences(self) -> list[Sequence]:
        """Every sequence in flight (waiting, running or swapped out)."""
        return list(self._by_request.values())

    def get(self, request_id: str) -> Sequence | None:
        return self._by_request.get(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._by_request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- one iteration ----

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.host_blocks is not None:
            self.host_blocks.begin_step()  # the last step's copies are made
        if self.blocks.state is not None:
            self.blocks.state.begin_step()
        budget = self.policy.max_num_batched_tokens
        head = self._make_room(out, now)  # a higher priority waiting preempts lower ones it needs room from
        self._speculating = self.proposer is not None and self.proposer.enabled(len(self._by_request))

        # Running sequences first, by priority then oldest: each needs its next token (or prompt chunk).
        # later[i]: blocks the sequences after running[i] need for their next token. Proposals leave
        # them free, so they never cost another sequence its blocks.
        later = [0] * len(self.running)
        for j in range(len(self.running) - 2, -1, -1) if self._speculating else ():
            after = self.running[j + 1]
            later[j] = later[j + 1] + self.blocks.blocks_needed(after, after.num_computed_tokens + 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, seq.num_computed_tokens, budget)  # 0: the rest would split an image
            ends = seq.num_pending and self._stop_reason(seq, -1, ahead=seq.num_pending) is not None
            if ends or not num_new:
                i += 1  # async scheduling (overlap.py): its token in flight ends it; no step after that
                continue
            drafts = self._propose(seq, budget - num_new) if num_new == 1 else []
            if drafts and not self.blocks.can_allocate(seq, seq.num_tokens + len(drafts), later[i]):
                drafts = []
            while not self.blocks.allocate(
                seq, seq.num_computed_tokens + num_new + len(drafts), count_query=False
            ):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: every later one is gone too
            out.scheduled.append(self._scheduled(seq, num_new, drafts))
            budget -= num_new + len(drafts)
            i += 1

        # None comes in during a step that preempts; swapped ones first, unless the waiting head outranks.
        if not out.preempted:
            budget = self._swap_in(out, budget, head)
            if not self.swapped or priority.yields_to(self.swapped[0], head):
                self._admit(out, budget, now)
        # The host tier's copies: evicted prefix blocks kept, and matched ones brought back.
        offloads, restores = self.blocks.take_copies()
        out.swap_out += offloads
        out.swap_in += restores
        # Introduced to the workers, whose rank 0 compiles their grammar (and waits a little if that is all).
        out.grammar_waiting = [s for s in self.waiting if not s.grammar_ready]
        if not out.is_empty:  # the workers hear of finished sequences with the next step that goes out
            out.forgotten_seq_ids, self._forgotten = self._forgotten, []
        return out

    def _propose(self, seq: Sequence, budget: int) -> list[int]:
        """Proposed tokens for a decoding sequence, within the step's budget and the sequence's limits
        (the KV of every proposal must fit in max_model_len; tokens past max_new_tokens would be
        dropped)."""
        if not self._speculating or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        room = min(
            budget,
            seq.max_new_tokens - seq.num_output_tokens - 1,
            self.policy.max_model_len - seq.num_tokens,
        )
        return self.proposer.propose(seq, room)[:room] if room > 0 else []

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:  # cut for forks and images; 0: none
        num_new = forks.limit(seq, min(seq.num_tokens - start, budget), start, self.blocks.block_size)
        return pooling.whole(seq, images.limit(seq, num_new, start), start)

    def _scheduled(self, seq: Sequence, num_new: int, drafts: list[int] = ()) -> ScheduledSeq:
        start = seq.num_computed_tokens
        sampled = start + num_new == seq.num_tokens and not seq.pooling  # caught up; pooling samples nothing
        drafts = list(drafts)
        item = ScheduledSeq(seq, num_new + len(drafts), 1 + len(drafts) if sampled else 0, drafts)
        if seq.prompt_logprobs is not None:
            # Positions up to the prompt's last but one predict prompt tokens; those not sent yet (a
            # recompute after a preemption computes them again) return their logprobs.
            end = min(start + num_new, seq.num_prompt_tokens - 1)
            item.num_prompt_logprobs = max(0, end - max(start, seq.prompt_logprobs_done))
        return item

    # ---- results of the iteration ----

    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[SequenceUpdate]:
        """Applies one step's results. sampled has, for each scheduled sequence with num_samples > 0 (in
        order), the 1 to num_samples tokens the worker produced: the proposals it accepted, then one
        more. Each is appended in turn and the stop conditions checked after each; a stop drops the
        rest. Proposals not accepted are rolled back: their KV is not counted as computed, and blocks
        the sequence no longer needs go back to the pool. Sequences aborted meanwhile are skipped."""
        updates = []
        for item, tokens in pooling.generating(self, out, sampled, updates):  # a pooling sequence ends
            seq = item.seq
            seq.prompt_logprobs_done += item.num_prompt_logprobs
            # The KV of the proposals the worker rejected is not part of the sequence.
            rejected = item.num_samples - len(tokens) if item.num_samples else 0
            seq.num_computed_tokens += item.num_new_tokens - rejected
            reason, kept = None, 0
            while reason is None and kept < len(tokens):
                seq.token_ids.append(tokens[kept])
                reason = self._stop_reason(seq, tokens[kept])
                kept += 1
            # Blocks whose every token is now computed (accepted proposals included, so after they are
            # appended: the hashes read the tokens) become reusable by later prompts.
            self.blocks.register_full_blocks(seq, min(seq.num_computed_tokens, seq.num_tokens))
            if not tokens:
                continue
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            elif rejected and self.blocks.truncate(seq, seq.num_tokens):
                seq.table_shrunk = True
            updates.append(SequenceUpdate(seq, tokens[:kept], reason is not None))
        return updates

    def _stop_reason(self, seq: Sequence, token: int, ahead: int = 0) -> int | None:
        if token in seq.stop_token_ids or (not seq.ignore_eos and token in self.eos_token_ids):
            return FINISH_REASON_EOS
        outputs = seq.num_output_tokens + ahead  # ahead: placeholders counted (overlap.py) or not
        if outputs >= seq.max_new_tokens or seq.num_prompt_tokens + outputs >= self.policy.max_model_len:
            return FINISH_REASON_LENGTH
        return None

    def _release(self, seq: Sequence, host: bool = True) -> None:
        """The one way a sequence lets go of memory: its device blocks and its prefix-hash
        registrations, and (unless it is being swapped out to them) its host blocks."""
        self.blocks.free(seq)
        if host and self.host_blocks is not None:
            self.host_blocks.free(seq.seq_id)
        if host and self.blocks.state is not None:
            self.blocks.state.drop_host(seq.seq_id)

    def _finish(self, seq: Sequence, reason: int) -> None:
        forks.unfork(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._by_request[seq.request_id]
        self._forgotten.append(seq.seq_id)
        self._static_batch.discard(seq.seq_id)

    def check_invariants(self) -> None:
        """Raises AssertionError unless the block accounting adds up (BlockManager.check_invariants over
        the running sequences' tables), only running sequences hold device blocks, and every swapped
        sequence holds host blocks."""
        self.blocks.check_invariants([s.block_table for s in self.running])
        if self.blocks.state is not None:
            self.blocks.state.check_invariants(
                [s.seq_id for s in self.running], [slot for _, slot in self.blocks._deferred_slots]
            )
        idle = (*self.waiting, *self.swapped)
        assert all(not s.block_table for s in idle), "a sequence not running holds blocks"
        if self.host_blocks is not None:
            self.host_blocks.check_invariants([s.seq_id for s in self.swapped])

    def snapshot(self) -> SchedulerSnapshot:
        """The counts every report reads (load reports, GetStats, metrics, the static fallback), so a
        number means the same thing in each."""
        return SchedulerSnapshot(
            waiting=len(self.waiting),
            running=len(self.running),
            swapped=len(self.swapped),
            num_preemptions=self.num_preemptions,
            **self.blocks.counts(),
        )
