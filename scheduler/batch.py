"""Turns the scheduler's plan for one iteration into the flat arrays every shard worker receives."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.scheduler import SchedulerOutput
from scheduler.sequence import Sequence


@dataclass
class StepPlan:
    step_id: int
    new_sequences: list[Sequence] = field(default_factory=list)  # first time the workers see them
    forgotten_seq_ids: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    do_sample: list[bool] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_table_lens: list[int] = field(default_factory=list)
    block_tables: list[int] = field(default_factory=list)
    # Block copies made before the forward: device -> host (swap out), then host -> device (swap in).
    swap_out_src: list[int] = field(default_factory=list)
    swap_out_dst: list[int] = field(default_factory=list)
    swap_in_src: list[int] = field(default_factory=list)
    swap_in_dst: list[int] = field(default_factory=list)


class StepBuilder:
    """Remembers which sequences the workers already know, so sampling state is sent only once."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._known: set[int] = set()
        self._next_step_id = 0

    def forget_all(self) -> None:
        """The workers restarted: every sequence must be introduced again."""
        self._known.clear()

    def build(self, out: SchedulerOutput) -> StepPlan:
        plan = StepPlan(step_id=self._next_step_id, forgotten_seq_ids=list(out.forgotten_seq_ids))
        plan.swap_out_src = [src for src, _ in out.swap_out]
        plan.swap_out_dst = [dst for _, dst in out.swap_out]
        plan.swap_in_src = [src for src, _ in out.swap_in]
        plan.swap_in_dst = [dst for _, dst in out.swap_in]
        self._next_step_id += 1
        for seq_id in out.forgotten_seq_ids:
            self._known.discard(seq_id)
        bs = self.block_size
        for item in out.scheduled:
            seq = item.seq
            if seq.seq_id not in self._known:
                self._known.add(seq.seq_id)
                plan.new_sequences.append(seq)
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            plan.seq_ids.append(seq.seq_id)
            plan.query_lens.append(item.num_new_tokens)
            plan.context_lens.append(end)
            plan.do_sample.append(item.do_sample)
            plan.input_ids.extend(seq.token_ids[start:end])
            plan.positions.extend(range(start, end))
            # Slots run contiguously inside a block, so extend one range per block touched.
            pos = start
            while pos < end:
                block_end = min(end, (pos // bs + 1) * bs)
                base = seq.block_table[pos // bs] * bs - (pos // bs) * bs
                plan.slot_mapping.extend(range(base + pos, base + block_end))
                pos = block_end
            plan.block_table_lens.append(len(seq.block_table))
            plan.block_tables.extend(seq.block_table)
        return plan
