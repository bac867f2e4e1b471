"""Encodes the scheduler's plan for one iteration straight into the StepRequest every shard worker gets.

The workers keep what they were told before: each sequence's sampling state (sent once, in
`new_sequences`) and its block table (sent as the blocks it gained since the last step). A sequence
whose blocks were all replaced (admitted, re-admitted after a recompute preemption, or swapped back in
to fresh blocks) gets its table sent whole, flagged as a reset. Positions and KV slots are not sent: the
workers derive them from each sequence's lengths and the table they hold. So a decode step of 128
sequences at context 2,048 carries a few hundred bytes of arrays, not 16,384 block ids.

Plain Python and protobuf: the arrays are `array('q')` (int64), packed with one tobytes() each.
"""

from __future__ import annotations

import sys
from array import array

from common.kv_cache_spec import HOLE
from common.pb.tpserve.internal.v1 import worker_pb2
from scheduler.plan import DRAFTED, SchedulerOutput
from scheduler.sequence import Sequence

# How long rank 0 may wait for a compiling grammar in a step that has nothing else to do: short enough
# that a request arriving meanwhile waits no longer than that for its step.
GRAMMAR_WAIT_MS = 20


def pack(values: array) -> bytes:
    """Little-endian bytes of an int64 array (the wire format of StepRequest's array fields)."""
    if sys.byteorder == "big":
        values = array("q", values)
        values.byteswap()
    return values.tobytes()


def sequence_init(seq: Sequence) -> worker_pb2.SequenceInit:
    return worker_pb2.SequenceInit(
        seq_id=seq.seq_id,
        sampling=seq.sampling,
        top_logprobs=seq.top_logprobs,
        token_ids=seq.token_ids,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_sampled=seq.num_output_tokens,
        stop_token_ids=sorted(seq.stop_token_ids),
        want_prompt_logprobs=seq.prompt_logprobs is not None,
        prompt_logprobs=seq.prompt_logprobs or 0,
        lora_name=seq.lora_name,
        pooling=seq.pooling,
        token_type_start=seq.token_type_start,
        images=seq.image_inputs,
    )


class StepBuilder:
    """Remembers what the workers already hold: which sequences they know (sampling state) and how many
    of each sequence's blocks they have."""

    def __init__(self):
        self._known: set[int] = set()  # seq ids whose sampling state the workers hold
        self._blocks_sent: dict[int, int] = {}  # seq id -> length of the table the workers hold
        self._next_step_id = 0

    def forget_all(self) -> None:
        """The workers restarted: every sequence must be introduced again."""
        self._known.clear()
        self._blocks_sent.clear()

    def build(self, out: SchedulerOutput) -> worker_pb2.StepRequest:
        req = worker_pb2.StepRequest(
            step_id=self._next_step_id,
            forgotten_seq_ids=out.forgotten_seq_ids,
            swap_out_src=[src for src, _ in out.swap_out],
            swap_out_dst=[dst for _, dst in out.swap_out],
            swap_in_src=[src for src, _ in out.swap_in],
            swap_in_dst=[dst for _, dst in out.swap_in],
            state_swap_out_src=[src for src, _ in out.state_swap_out],
            state_swap_out_dst=[dst for _, dst in out.state_swap_out],
            state_swap_in_src=[src for src, _ in out.state_swap_in],
            state_swap_in_dst=[dst for _, dst in out.state_swap_in],
        )
        self._next_step_id += 1
        for seq_id in out.forgotten_seq_ids:
            self._known.discard(seq_id)
            self._blocks_sent.pop(seq_id, None)
        # Sequences waiting for their grammar are introduced before they are scheduled: rank 0 compiles it.
        for seq in out.grammar_waiting:
            if seq.seq_id not in self._known:
                self._known.add(seq.seq_id)
                req.new_sequences.append(sequence_init(seq))
        if out.only_grammars:
            req.grammar_wait_ms = GRAMMAR_WAIT_MS
        # Sequences holding a table of fresh blocks this step.
        fresh = {s.seq_id for s in out.admitted} | {s.seq_id for s in out.swapped_in}
        seq_ids, query_lens, context_lens, sample_counts = array("q"), array("q"), array("q"), array("q")
        prompt_logprob_counts = array("q")
        draft_counts = array("q")
        state_slots = array("q")
        group_ids = [array("q") for _ in out.scheduled[0].seq.group_tables] if out.scheduled else []
        input_ids, table_reset, new_block_counts, new_block_ids = (
            array("q"),
            array("q"),
            array("q"),
            array("q"),
        )
        for item in out.scheduled:
            seq = item.seq
            if seq.seq_id not in self._known:
                self._known.add(seq.seq_id)
                req.new_sequences.append(sequence_init(seq))
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            seq_ids.append(seq.seq_id)
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            sample_counts.append(item.num_samples)
            if seq.state_slot is not None:
                state_slots.append(seq.state_slot)
            prompt_logprob_counts.append(item.num_prompt_logprobs)
            # Proposals sit after the sequence's own tokens, which end at its last one. The draft model's
            # are made on the workers: only their count travels.
            drafts = item.draft_token_ids
            input_ids.extend(seq.token_ids[start : end - len(drafts)])
            drafted = len(drafts) if drafts and drafts[0] == DRAFTED else 0
            draft_counts.append(drafted)
            if not drafted:
                input_ids.extend(drafts)
            # A table that shrank (blocks of rejected proposals returned) is sent whole too.
            sent = self._blocks_sent.get(seq.seq_id)
            reset = seq.seq_id in fresh or sent is None or seq.table_shrunk
            seq.table_shrunk = False
            sent = 0 if reset else sent
            table_reset.append(int(reset))
            new_block_counts.append(len(seq.block_table) - sent)
            new_block_ids.extend(_ids(seq.block_table[sent:]))
            for ids, table in zip(group_ids, seq.group_tables, strict=True):
                ids.extend(_ids(table[sent:]))
            self._blocks_sent[seq.seq_id] = len(seq.block_table)
        req.seq_ids = pack(seq_ids)
        req.query_lens = pack(query_lens)
        req.context_lens = pack(context_lens)
        req.sample_counts = pack(sample_counts)
        if any(prompt_logprob_counts):  # nearly never: no bytes for it otherwise
            req.prompt_logprob_counts = pack(prompt_logprob_counts)
        req.input_ids = pack(input_ids)
        if any(draft_counts):  # most steps have none: the field stays empty
            req.draft_counts = pack(draft_counts)
        req.table_reset = pack(table_reset)
        req.new_block_counts = pack(new_block_counts)
        req.new_block_ids = pack(new_block_ids)
        if state_slots:
            req.state_slots = pack(state_slots)
        if group_ids:
            req.group_new_block_ids = pack(array("q", [b for ids in group_ids for b in ids]))
        return req


def _ids(table: list[int]) -> list[int]:
    """A table's entries as the workers get them: a hole (a block let go of, never read again) as 0."""
    return [0 if b == HOLE else b for b in table]
