"""Who leaves the batch and how it comes back (the Scheduler, scheduler/scheduler.py, inherits it).

When a block cannot be had, the last running sequence is preempted, as are those of lower priority a
waiting one of strictly higher priority needs room from (scheduler/priority.py). With host blocks (swap
space) free for it, its KV is swapped out to them and it waits in `swapped` with its progress kept;
otherwise its blocks are freed and it is recomputed later from the tokens kept here: the output is the
same. Swapped sequences come back before any waiting one of no higher priority. The prefix cache's host
tier shares those host blocks. When the ranks lose their caches (a rank restarted), every sequence goes
back to the queue to be recomputed, and the block pools are replaced by the ones the returning ranks
hold. Plain Python, no gRPC, no torch.
"""

from __future__ import annotations

import dataclasses

from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_ABORTED
from scheduler import lora_slots, priority
from scheduler.block_manager import BlockManager
from scheduler.plan import SchedulerOutput
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.swap import HostBlockPool


class Preemption:
    def _make_room(self, out: SchedulerOutput, now: float) -> Sequence | None:
        """Preempts lower priorities (priority.victim) while the next to admit finds no slot or blocks
        (priority.fits); it comes in next step (none does in a step that preempts). Returns it, or None."""
        head = next(iter(self._candidates(now)), None) if self.batching == "continuous" else None
        args = (self.blocks, self.policy, self._watermark_blocks, now, self.step_s)
        while (v := priority.to_preempt(head, self.running, *args)) is not None:
            self._preempt(v, out)
        return head

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap preemption when the host has room for seq's computed KV: it is copied out before this
        step's forward, and seq keeps its progress. Otherwise recompute preemption: the tokens stay
        here, the KV is dropped. Either way seq's device blocks go back to the pool now."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        # Only blocks holding computed tokens that later queries read are worth copying.
        computed = self.blocks.computed_blocks(seq)
        state = self.blocks.state  # a recurrent state goes with the blocks (scheduler/state_slots.py)
        room = state is None or state.can_swap_out()
        if self.host_blocks is not None and room and self.host_blocks.can_swap_out(len(computed)):
            out.swap_out += self.host_blocks.swap_out(seq.seq_id, computed)
            if state is not None:
                out.state_swap_out.append(state.swap_out(seq.seq_id))
            self._release(seq, host=False)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.swapped.sort(key=lambda s: (s.priority, s.seq_id))
            out.swapped_out.append(seq)
            return
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _swap_in(self, out: SchedulerOutput, budget: int, head: Sequence | None) -> int:
        """Brings swapped sequences back, by priority then oldest first, into fresh device blocks (never
        shared with the prefix cache), unless head (the next to admit) ranks higher. Returns budget left."""
        while self.swapped and budget > 0 and len(self.running) < self.policy.max_num_seqs:
            seq = self.swapped[0]
            if not lora_slots.fits(seq, self.running, self.policy.max_loras) or priority.yields_to(seq, head):
                break
            num_new = self._chunk(seq, seq.num_computed_tokens, budget)
            reserve = self._watermark_blocks if self.running else 0
            if not num_new or not self.blocks.can_allocate(seq, seq.num_computed_tokens + num_new, reserve):
                break
            self.blocks.allocate(seq, seq.num_computed_tokens + num_new, count_query=False)
            out.swap_in += self.host_blocks.swap_in(seq.seq_id, self.blocks.computed_blocks(seq))
            if self.blocks.state is not None:
                out.state_swap_in.append(self.blocks.state.swap_in(seq.seq_id))
            self.swapped.pop(0)
            seq.status = SequenceStatus.RUNNING
            priority.insert(self.running, seq)
            out.swapped_in.append(seq)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        return budget

    def requeue_all(self) -> None:
        """The workers lost their KV caches (a rank restarted), host copies included: every running
        sequence, then every swapped one, goes back to the front of the queue, in order, to be
        recomputed from the tokens kept here."""
        for seq in reversed(self.running + self.swapped):
            self._release(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        for seq in self.waiting:  # the new rank 0 compiles every grammar again
            seq.grammar_ready = not seq.has_grammar
        self.running = []
        self.swapped = []
        self._forgotten = []  # the new workers know nothing to forget

    def replace_blocks(
        self,
        block_manager: BlockManager,
        host_blocks: HostBlockPool | None = None,
        max_model_len: int | None = None,
    ) -> list[Sequence]:
        """Fresh pools after the workers came back. Their capacity may differ: with a smaller
        max_model_len, sequences that can no longer fit are dropped and returned (the engine fails them)."""
        if self.running or self.swapped:
            raise RuntimeError("requeue_all() first: sequences hold blocks of the old pools")
        self.blocks = block_manager
        self.host_blocks = host_blocks
        self._watermark_blocks = int(self.policy.admission_watermark * block_manager.num_blocks)
        too_long = []
        if max_model_len is not None and max_model_len != self.policy.max_model_len:
            self.policy = dataclasses.replace(self.policy, max_model_len=max_model_len)
            too_long = [s for s in self.waiting if s.num_prompt_tokens + s.max_new_tokens > max_model_len]
            for seq in too_long:
                self.waiting.remove(seq)
                self._finish(seq, FINISH_REASON_ABORTED)
        return too_long
