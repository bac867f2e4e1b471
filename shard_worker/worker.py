"""One rank of the model: the sequences the scheduler told it about, and the steps it runs for them.

Each sequence the worker knows is one WorkerSequence: its block table (a row of one int64 array, so a
step's batch table is one fancy-indexed copy) and, on rank 0, its sampling state. The scheduler owns the
truth; a worker only applies what each step says changed, in this order: forget finished sequences,
introduce new ones, swap blocks out then in, bring the block tables up to date, run the forward.
No gRPC here: shard_worker/server.py decodes the StepRequest, calls step(), encodes the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_worker.block_tables import BlockTables
from shard_worker.sampling import SequenceState
from shard_worker.step import StepInputs, StepOutputs, WorkerStep


@dataclass
class WorkerSequence:
    seq_id: int
    sampling: SequenceState | None  # rank 0 only


class Worker:
    def __init__(self, runner):
        self.runner = runner
        self.tables: BlockTables | None = None
        self.sequences: dict[int, WorkerSequence] = {}

    def init_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        max_model_len: int,
        max_num_seqs: int = 0,
    ):
        """Allocates the KV cache (and the swap space) for a new scheduler session, which introduces
        every sequence again: what this worker knew of the last one is dropped; then captures the decode
        graphs for up to max_num_seqs sequences over it (CUDA; they bake in its addresses). Returns the
        bytes the cache and the swap space take."""
        self.forget(list(self.sequences))
        self.tables = BlockTables(-(-max_model_len // block_size))
        nbytes = self.runner.allocate_kv_cache(num_blocks, block_size)
        host_bytes = self.runner.allocate_host_kv_cache(num_host_blocks, block_size)
        self.runner.capture_cuda_graphs(max_num_seqs, max_model_len)
        return nbytes, host_bytes

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            seq = self.sequences.pop(int(seq_id), None)
            if seq is not None and seq.sampling is not None:
                self.runner.sampler.release(seq.sampling)
        if self.runner.draft is not None:  # its per-sequence state (shard_worker/draft.py)
            self.runner.draft.forget(seq_ids)
        if self.tables is not None:
            self.tables.forget(seq_ids)

    def step(self, step: WorkerStep) -> StepOutputs:
        if self.tables is None:
            raise RuntimeError("InitCache must come before the first step")
        self.forget(step.forgotten_seq_ids)
        sampler = self.runner.sampler
        for init in step.new_sequences:
            self.forget([init.seq_id])  # a sequence introduced again is rebuilt from its tokens
            state = sampler.new_state(init) if sampler is not None else None
            self.sequences[init.seq_id] = WorkerSequence(init.seq_id, state)
        # Swap out first: its device blocks may be handed to this step's tokens or swap ins.
        if step.swap_out[0]:
            self.runner.swap_out(*step.swap_out)
        if step.swap_in[0]:
            self.runner.swap_in(*step.swap_in)
        block_table = self.tables.apply(
            step.seq_ids, step.table_reset, step.new_block_counts, step.new_block_ids
        )
        inputs = StepInputs(
            seq_ids=step.seq_ids,
            query_lens=step.query_lens,
            context_lens=step.context_lens,
            sample_counts=step.sample_counts,
            input_ids=step.input_ids,
            block_table=block_table,
            draft_counts=step.draft_counts,
        )
        states = None
        if sampler is not None:
            try:
                states = [
                    self.sequences[int(i)].sampling
                    for i, n in zip(step.seq_ids, step.sample_counts, strict=True)
                    if n
                ]
            except KeyError as e:
                raise KeyError(f"sequence {e.args[0]} was never introduced to this worker") from None
        return self.runner.execute(inputs, states)
