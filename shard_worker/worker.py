"""One rank of the model: the sequences the scheduler told it about, and the steps it runs for them.

Each sequence the worker knows is one WorkerSequence: its block table (a row of one int64 array, so a
step's batch table is one fancy-indexed copy) and, on rank 0, its sampling state. The scheduler owns the
truth; a worker only applies what each step says changed, in this order: forget finished sequences,
introduce new ones, swap blocks out then in, bring the block tables up to date, put in the tokens the
last step sampled where the step has placeholders for them (async scheduling), run the forward.
A sequence with a grammar (structured outputs) is introduced while it still waits in the scheduler's
queue; its grammar compiles on a thread, and each step's answer names the sequences whose grammar became
ready, which the scheduler then admits. No gRPC here: shard_worker/servicer.py decodes the StepRequest,
calls step(), encodes the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from shard_worker.block_tables import BlockTables
from shard_worker.pooling import token_types
from shard_worker.sampling import SequenceState
from shard_worker.step import StepInputs, StepOutputs, WorkerStep


@dataclass
class WorkerSequence:
    """Everything this rank holds for one sequence: forgetting it is dropping this object (and giving
    back what it holds elsewhere: its table row, its sampler state)."""

    seq_id: int
    row: int  # its block table's row (BlockTables)
    sampling: SequenceState | None  # rank 0 only
    # Prompt logprobs wanted: the prompt (every rank: they all compute the rows' logits, a collective)
    # and the alternatives per position.
    prompt: list[int] | None = None
    prompt_top: int = 0
    grammar_pending: bool = False  # rank 0: its grammar is compiling and not yet reported ready
    draft: object | None = None  # the draft model's progress on it (shard_worker/draft.py)
    lora_name: str = ""  # its LoRA adapter (shard_worker/model/lora); "": the base model
    pooling: bool = False  # pooled in its one step (shard_worker/pooling.py), never sampled
    token_type_start: int = 0
    images: tuple = ()  # its prompt's images (shard_worker/images.py), for the vision encoder
    mrope: object | None = None  # its prompt's M-RoPE positions (shard_worker/mrope.py), with images


class Worker:
    def __init__(self, runner, threads=None):
        """threads: a config.StepThreads that sizes torch's CPU threads per step, or None."""
        self.runner = runner
        self.threads = threads
        self.tables: BlockTables | None = None
        # The other layer groups' tables (common/kv_cache_spec.py), a sequence's row the same in each.
        self.group_tables: list[BlockTables] = []
        self.sequences: dict[int, WorkerSequence] = {}

    def init_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        max_model_len: int,
        max_num_seqs: int = 0,
        num_state_slots: int = 0,
        num_host_state_slots: int = 0,
    ):
        """Allocates the KV cache (and the swap space) for a new scheduler session, which introduces
        every sequence again: what this worker knew of the last one is dropped; then captures the decode
        graphs for up to max_num_seqs sequences over it (CUDA; they bake in its addresses). Returns the
        bytes the cache and the swap space take."""
        if self.tables is not None:
            self.forget(list(self.sequences))
        self.tables = BlockTables(-(-max_model_len // block_size), num_blocks, block_size)
        groups = self.runner.model.kv_layout.num_groups if self.runner.model.kv_layout is not None else 1
        self.group_tables = [
            BlockTables(-(-max_model_len // block_size), num_blocks, block_size) for _ in range(groups - 1)
        ]
        nbytes = self.runner.allocate_kv_cache(num_blocks, block_size)
        host_bytes = self.runner.allocate_host_kv_cache(num_host_blocks, block_size)
        nbytes += self.runner.allocate_state_cache(num_state_slots, num_host_state_slots)
        self.runner.capture_cuda_graphs(max_num_seqs, max_model_len)
        return nbytes, host_bytes

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            seq = self.sequences.pop(int(seq_id), None)
            if seq is None:
                continue
            self.tables.release(seq.row)
            for tables in self.group_tables:
                tables.release(seq.row)
            if seq.sampling is not None:
                self.runner.sampler.release(seq.sampling)
            if seq.images and self.runner.encoder_cache is not None:
                self.runner.encoder_cache.forget(seq.seq_id)  # outputs it held are only cached now

    def step(self, step: WorkerStep) -> StepOutputs:
        if self.tables is None:
            raise RuntimeError("InitCache must come before the first step")
        self.forget(step.forgotten_seq_ids)
        sampler = self.runner.sampler
        for init in step.new_sequences:
            self.forget([init.seq_id])  # a sequence introduced again is rebuilt from its tokens
            self.runner.check_lora(init.lora_name)  # before anything is taken for it
            state = sampler.new_state(init) if sampler is not None else None
            row = self.tables.take_row()
            if any(tables.take_row() != row for tables in self.group_tables):
                raise RuntimeError("the layer groups' block tables disagree on a sequence's row")
            self.sequences[init.seq_id] = WorkerSequence(
                init.seq_id,
                row,
                state,
                prompt=init.token_ids[: init.num_prompt_tokens] if init.want_prompt_logprobs else None,
                prompt_top=init.prompt_logprobs,
                grammar_pending=state is not None and init.sampling.structured is not None,
                lora_name=init.lora_name,
                pooling=init.pooling,
                token_type_start=init.token_type_start,
                images=init.images,
                mrope=self._mrope(init),
            )
        ready, errors = self._grammars(step.grammar_wait_ms / 1000)
        # Swap out first: its device blocks may be handed to this step's tokens or swap ins.
        if step.swap_out[0]:
            self.runner.swap_out(*step.swap_out)
        if step.swap_in[0]:
            self.runner.swap_in(*step.swap_in)
        if step.state_swap_out[0]:
            self.runner.swap_states(*step.state_swap_out, out=True)
        if step.state_swap_in[0]:
            self.runner.swap_states(*step.state_swap_in, out=False)
        if not len(step.seq_ids):  # only grammars to wait for (every rank answers at once)
            return StepOutputs(grammar_ready_seq_ids=ready, grammar_errors=errors)
        try:
            batch = [self.sequences[int(i)] for i in step.seq_ids]
        except KeyError as e:
            raise KeyError(f"sequence {e.args[0]} was never introduced to this worker") from None
        if (step.input_ids < 0).any():
            step.input_ids = self._fill_placeholders(step, batch)
        rows = np.fromiter((seq.row for seq in batch), dtype=np.int64, count=len(batch))
        block_table = self.tables.apply(
            step.seq_ids, rows, step.table_reset, step.new_block_counts, step.new_block_ids, step.context_lens
        )
        group_ids = (
            step.group_new_block_ids if step.group_new_block_ids is not None else np.zeros(0, np.int64)
        )
        if len(group_ids) != len(step.new_block_ids) * len(self.group_tables):
            raise ValueError(
                f"{len(group_ids)} group block ids for {len(self.group_tables)} more groups of "
                f"{len(step.new_block_ids)}"
            )
        group_ids = np.split(group_ids, len(self.group_tables)) if self.group_tables else []
        group_block_tables = [
            t.apply(step.seq_ids, rows, step.table_reset, step.new_block_counts, ids, step.context_lens)
            for t, ids in zip(self.group_tables, group_ids, strict=True)
        ]
        inputs = StepInputs(
            seq_ids=step.seq_ids,
            query_lens=step.query_lens,
            context_lens=step.context_lens,
            sample_counts=step.sample_counts,
            input_ids=step.input_ids,
            block_table=block_table,
            group_block_tables=group_block_tables,
            state_slots=step.state_slots,
            draft_counts=step.draft_counts,
            sequences=batch,
        )
        if step.prompt_logprob_counts is not None:
            self._prompt_rows(step, inputs)
        pool = [i for i, seq in enumerate(batch) if seq.pooling]
        if pool:
            self._pool_rows(step, inputs, batch, np.asarray(pool, dtype=np.int64))
        states = None
        if sampler is not None:
            states = [seq.sampling for seq, n in zip(batch, step.sample_counts, strict=True) if n]
        grammar = sampler.grammar if sampler is not None else None
        before = (grammar.mask_seconds, grammar.fill_seconds) if grammar is not None else None
        if self.threads is not None:
            self.threads.before_step(len(step.input_ids))
        out = self.runner.execute(inputs, states)
        out.grammar_ready_seq_ids, out.grammar_errors = ready, errors
        if grammar is not None:
            out.grammar_mask_seconds = grammar.mask_seconds - before[0]
            out.grammar_fill_seconds = grammar.fill_seconds - before[1]
        return out

    def _mrope(self, init):
        """The prompt's M-RoPE table, for a model with M-RoPE (Qwen VL) and a prompt with images."""
        positions_of = getattr(self.runner.model, "prompt_positions", None)
        if positions_of is None or not init.images:
            return None
        return positions_of(init.token_ids[: init.num_prompt_tokens], init.images)

    def _fill_placeholders(self, step: WorkerStep, batch: list[WorkerSequence]) -> np.ndarray:
        """Async scheduling (scheduler/overlap.py): the step was planned before the last one's tokens were
        known, and a sequence sampled then carries a placeholder (negative) for its token. Rank 0 puts in
        the last token it sampled for each, and every rank gets them from it (it alone samples)."""
        ids = step.input_ids.copy()
        holes = np.flatnonzero(ids < 0)
        owners = np.searchsorted(np.cumsum(step.query_lens), holes, side="right")
        tokens = torch.zeros(len(holes), dtype=torch.int64)
        if self.runner.tp.rank == 0:
            for k, i in enumerate(owners.tolist()):
                state = batch[i].sampling
                if state is None or not state.output_ids:
                    raise ValueError(f"sequence {batch[i].seq_id} has a placeholder and no token sampled")
                tokens[k] = state.output_ids[-1]
        if self.runner.tp.world_size > 1:
            tokens = self.runner.tp.broadcast_from_rank0(tokens.to(self.runner.device)).cpu()
        ids[holes] = tokens.numpy()
        return ids

    def _pool_rows(self, step: WorkerStep, inputs: StepInputs, batch, index: np.ndarray) -> None:
        """The step's pooling sequences, each whole (a prompt never chunked), and their token types."""
        whole = step.query_lens[index] == step.context_lens[index]
        if not whole.all():
            raise ValueError(
                f"pooling sequence {batch[int(index[~whole][0])].seq_id} is not whole in its step"
            )
        inputs.pool_index = index
        inputs.token_type_ids = token_types(
            step.query_lens, index, [batch[i].token_type_start for i in index]
        )

    def _prompt_rows(self, step: WorkerStep, inputs: StepInputs) -> None:
        """The rows giving prompt logprobs: for a sequence counting n, its last n query positions before
        e = min(context_len, len(prompt) - 1); position p predicts prompt token p + 1."""
        rows, targets, tops = [], [], []
        q_starts = np.cumsum(step.query_lens) - step.query_lens
        for i in np.flatnonzero(step.prompt_logprob_counts):
            seq = self.sequences[int(step.seq_ids[i])]
            if seq.prompt is None:
                raise ValueError(f"sequence {seq.seq_id} asked no prompt logprobs")
            n, context = int(step.prompt_logprob_counts[i]), int(step.context_lens[i])
            first_pos = context - int(step.query_lens[i])
            end = min(context, len(seq.prompt) - 1)
            rows.extend(int(q_starts[i]) + p - first_pos for p in range(end - n, end))
            targets.extend(seq.prompt[end - n + 1 : end + 1])
            tops.extend([seq.prompt_top] * n)
        inputs.prompt_rows, inputs.prompt_targets, inputs.prompt_tops = (
            np.asarray(rows, dtype=np.int64),
            np.asarray(targets, dtype=np.int64),
            np.asarray(tops, dtype=np.int64),
        )

    def _grammars(self, wait_s: float) -> tuple[list[int], list[tuple[int, str]]]:
        """The pending grammars that are ready now, and those that failed; with wait_s, waits that long
        for the first of them (a step that computes nothing, sent only to wait for grammars)."""
        ready, errors = [], []
        deadline = time.monotonic() + wait_s
        for seq in self.sequences.values():
            if not seq.grammar_pending:
                continue
            try:
                timeout = 0.0 if ready else max(0.0, deadline - time.monotonic())
                done = self.runner.sampler.grammar_ready(seq.sampling, timeout)
            except Exception as e:  # a grammar llguidance refuses, or a model without a tokenizer
                message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                errors.append((seq.seq_id, message))
                seq.grammar_pending = False
                continue
            if done:
                ready.append(seq.seq_id)
                seq.grammar_pending = False
        return ready, errors
