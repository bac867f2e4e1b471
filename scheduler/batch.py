"""Turns the scheduler's plan for one iteration into the flat arrays every shard worker receives.

The workers keep what they were told before: each sequence's sampling state (sent once, in
`new_sequences`) and its block table (sent as the blocks it gained since the last step). A sequence
whose blocks were all replaced (admitted, re-admitted after a recompute preemption, or swapped back in
to fresh blocks) gets its table sent whole, flagged as a reset. So a decode step of 128 sequences at
context 2,048 carries a few block ids, not 16,384.

Plain Python: the arrays are `array('q')` (int64), which the engine packs with one tobytes() each.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field

from scheduler.scheduler import SchedulerOutput
from scheduler.sequence import Sequence


def _int64() -> array:
    return array("q")


@dataclass
class StepPlan:
    step_id: int
    new_sequences: list[Sequence] = field(default_factory=list)  # first time the workers see them
    forgotten_seq_ids: list[int] = field(default_factory=list)
    # Per sequence, in batch order.
    seq_ids: array = field(default_factory=_int64)
    query_lens: array = field(default_factory=_int64)
    context_lens: array = field(default_factory=_int64)
    do_sample: array = field(default_factory=_int64)  # 1: sample after its last token this step
    table_reset: array = field(default_factory=_int64)  # 1: its block table starts over
    new_block_counts: array = field(default_factory=_int64)
    # Per token, each sequence's tokens contiguous, in batch order.
    input_ids: array = field(default_factory=_int64)
    positions: array = field(default_factory=_int64)
    slot_mapping: array = field(default_factory=_int64)
    # The blocks each sequence gained since the workers last heard of it, concatenated in batch order.
    new_block_ids: array = field(default_factory=_int64)
    # Block copies made before the forward: device -> host (swap out), then host -> device (swap in).
    swap_out_src: list[int] = field(default_factory=list)
    swap_out_dst: list[int] = field(default_factory=list)
    swap_in_src: list[int] = field(default_factory=list)
    swap_in_dst: list[int] = field(default_factory=list)

    @staticmethod
    def pack(values: array) -> bytes:
        """Little-endian bytes of an int64 array (the wire format of StepRequest's array fields)."""
        if sys.byteorder == "big":
            values = array("q", values)
            values.byteswap()
        return values.tobytes()


class StepBuilder:
    """Remembers what the workers already hold: which sequences they know (sampling state) and how many
    of each sequence's blocks they have."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._known: set[int] = set()  # seq ids whose sampling state the workers hold
        self._blocks_sent: dict[int, int] = {}  # seq id -> length of the table the workers hold
        self._next_step_id = 0

    def forget_all(self) -> None:
        """The workers restarted: every sequence must be introduced again."""
        self._known.clear()
        self._blocks_sent.clear()

    def build(self, out: SchedulerOutput) -> StepPlan:
        plan = StepPlan(step_id=self._next_step_id, forgotten_seq_ids=list(out.forgotten_seq_ids))
        plan.swap_out_src = [src for src, _ in out.swap_out]
        plan.swap_out_dst = [dst for _, dst in out.swap_out]
        plan.swap_in_src = [src for src, _ in out.swap_in]
        plan.swap_in_dst = [dst for _, dst in out.swap_in]
        self._next_step_id += 1
        for seq_id in out.forgotten_seq_ids:
            self._known.discard(seq_id)
            self._blocks_sent.pop(seq_id, None)
        # Sequences holding a table of fresh blocks this step.
        fresh = {s.seq_id for s in out.admitted} | {s.seq_id for s in out.swapped_in}
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
            plan.do_sample.append(int(item.do_sample))
            plan.input_ids.extend(seq.token_ids[start:end])
            plan.positions.extend(range(start, end))
            # Slots run contiguously inside a block, so extend one range per block touched.
            pos = start
            while pos < end:
                block_end = min(end, (pos // bs + 1) * bs)
                base = seq.block_table[pos // bs] * bs - (pos // bs) * bs
                plan.slot_mapping.extend(range(base + pos, base + block_end))
                pos = block_end
            reset = seq.seq_id in fresh or seq.seq_id not in self._blocks_sent
            sent = 0 if reset else self._blocks_sent[seq.seq_id]
            plan.table_reset.append(int(reset))
            plan.new_block_counts.append(len(seq.block_table) - sent)
            plan.new_block_ids.extend(seq.block_table[sent:])
            self._blocks_sent[seq.seq_id] = len(seq.block_table)
        return plan
