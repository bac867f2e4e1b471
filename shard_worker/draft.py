"""Speculative decoding's draft model (`--speculative-model`): a smaller checkpoint with the target's
vocabulary, run by the same shard workers, proposing tokens that the target verifies in the same step.

Proposal flow. The scheduler decides who speculates and how far (StepRequest.draft_counts: k for a
decoding sequence, with k more positions and k budget tokens reserved for it). Before the target's
forward, the draft runs k autoregressive passes and its tokens take those positions: the target then
verifies them in its one forward of that same step. So the draft only writes KV into slots of blocks
the step already holds, a proposal is never stale, and the scheduler's token budget, preemption and
the rollback of rejected tokens work exactly as for n-gram proposals.

KV. The draft has its own paged cache, of its own shape, addressed by the same block ids and tables as
the target's: no second allocator, a block's bytes count both (so profiling and capacity.py see one
block size), and swaps copy both caches block for block. Each sequence's draft KV follows the target's:
the draft computes every token the target computes, prompt chunks included, in the same step and within
its budget; it never runs its own last proposal (nothing would read that KV), and its KV of rejected
proposals is not counted. So a sequence's draft KV lags by at most the tokens the last verification
accepted past the draft's; they are the first tokens of its next pass, taken from the last step's inputs
that the worker keeps. The state a worker keeps is only that (per sequence: how far its draft KV goes,
and its last step's tokens): a sequence introduced again, or a new scheduler session, starts the draft
over with the target's recompute. Where the draft's KV cannot be vouched for (a prefix-cache hit on
blocks a sequence filled before its draft caught up) it is used anyway: that can only make proposals
worse, never the output different, since the target verifies every one.

Tensor parallelism: the draft is sharded like the target on every rank (its row-parallel layers
all-reduce, its LM head gathers to rank 0); rank 0 draws each depth's proposals and broadcasts them, so
every rank feeds both models the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from shard_worker.attention import StepBatch
from shard_worker.model.loader import load_model
from shard_worker.sampling.speculative import draft_tokens, uses_rejection
from shard_worker.step import StepInputs


@dataclass
class _DraftSequence:
    computed: int  # positions [0, computed) hold the draft's KV
    start: int  # the position of the first of the last step's input tokens
    tokens: list[int]  # the last step's input tokens (its own, then the proposals), from start


class DraftModel:
    def __init__(self, model_dir, dtype, device, tp, attention, target_config, check=None, linear_dtype=None):
        """check(model), linear_dtype: as load_model's."""
        self.name = Path(model_dir).resolve().name
        self.dtype, self.device, self.tp, self.attention = dtype, device, tp, attention
        self.config, self.model = load_model(
            model_dir, dtype, device, tp, check=check, linear_dtype=linear_dtype
        )
        if self.config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"--speculative-model {model_dir}: vocab_size {self.config.vocab_size}, the model's is "
                f"{target_config.vocab_size}: a draft model must share the model's tokenizer"
            )
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.host_kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        # Unseeded proposals' draws (rank 0); seeded ones take the target's (seed, position) uniforms.
        self._generator = torch.Generator(device)
        self._generator.seed()

    def kv_block_bytes(self, block_size: int) -> int:
        per_cache = math.prod(self.model.kv_cache_shape(1, block_size)) * self.dtype.itemsize
        return self.model.num_kv_caches * per_cache

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """A fresh cache (with the target's): no sequence's draft KV is in it (the worker forgets every
        sequence, and with them their draft progress)."""
        self.kv_caches = []  # the old one first, so that both never take memory at once
        self.kv_caches = self.model.new_kv_caches(num_blocks, block_size, self.dtype, self.device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    def allocate_host(self, num_blocks: int, block_size: int) -> None:
        self.host_kv_caches = []
        self.host_kv_caches = self.model.new_kv_caches(
            num_blocks, block_size, self.dtype, self.device, host=True
        )

    def propose(self, inputs: StepInputs, states) -> tuple[StepInputs, list[torch.Tensor | None] | None]:
        """Runs the draft over the step's own tokens (each sequence first catching up on what it lacks)
        and proposes draft_counts[i] tokens for sequence i. Returns the step with its proposals in
        input_ids and, on rank 0, per sampled sequence (in the order of `states`) the [k, vocab]
        distributions its proposals were drawn from where the rejection rule judges them, else None."""
        k = inputs.draft_counts
        own = inputs.query_lens - k  # the sequence's own tokens this step; proposals follow them
        starts = inputs.context_lens - inputs.query_lens
        ends = starts + own
        segments = np.split(inputs.input_ids, np.cumsum(own)[:-1])
        ids, lens = [], np.empty(len(own), dtype=np.int64)
        for i, seg in enumerate(segments):
            catch_up = self._catch_up(_progress(inputs, i), int(starts[i]))
            ids += [np.asarray(catch_up, dtype=np.int64), seg]
            lens[i] = len(catch_up) + len(seg)
        hidden = self._forward(np.concatenate(ids), lens, ends, inputs.block_table)

        drafting = np.flatnonzero(k)
        drafts = np.zeros((len(drafting), int(k.max()) if len(drafting) else 0), dtype=np.int64)
        probs: dict[int, list[torch.Tensor]] = {}
        if len(drafting):
            sampled = np.flatnonzero(inputs.sample_counts)
            state_of = dict(zip(sampled.tolist(), range(len(sampled)), strict=True))
            rows = np.cumsum(lens)[drafting] - 1
            for depth in range(drafts.shape[1]):
                live = np.flatnonzero(k[drafting] > depth)  # rows of drafts still proposing
                seqs = drafting[live]
                if depth:  # the last proposal of each, one position further: one token per sequence
                    one = np.ones(len(live), dtype=np.int64)
                    table = inputs.block_table[seqs]
                    hidden = self._forward(drafts[live, depth - 1], one, ends[seqs] + depth, table)
                    rows = np.arange(len(live))
                logits = self.model.compute_logits(hidden[torch.from_numpy(rows).to(self.device)])
                chosen = torch.empty(len(live), dtype=torch.int64, device=self.device)
                if logits is not None:  # rank 0 draws
                    live_states = [states[state_of[int(i)]] for i in seqs]
                    chosen, q = draft_tokens(live_states, logits, depth, self._generator)
                    for row, i in enumerate(seqs.tolist()):
                        if q is not None and uses_rejection(live_states[row].config):
                            probs.setdefault(i, []).append(q[row])
                drafts[live, depth] = self.tp.broadcast_from_rank0(chosen).cpu().numpy()

        self._remember(inputs, segments, starts, ends, drafting, drafts)
        if not len(drafting):
            return inputs, None
        # The step's input ids with each sequence's proposals after its own tokens.
        q_lens = inputs.query_lens
        full = np.empty(int(q_lens.sum()), dtype=np.int64)
        offset = np.arange(len(full)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        mine = offset < np.repeat(own, q_lens)
        full[mine] = inputs.input_ids
        full[~mine] = drafts[np.arange(drafts.shape[1]) < k[drafting][:, None]]
        per_state = None
        if states is not None:
            sampled = np.flatnonzero(inputs.sample_counts)
            per_state = [torch.stack(probs[i]) if i in probs else None for i in sampled.tolist()]
        return replace(inputs, input_ids=full), per_state

    def _catch_up(self, seq: _DraftSequence | None, start: int) -> list[int]:
        """The tokens before `start` (where the target's computed KV ends) whose draft KV is missing."""
        if seq is None:
            return []  # new to the draft: computed from 0 with the target, or a prefix cached for both
        computed = min(seq.computed, start)
        if not (seq.start <= computed and start <= seq.start + len(seq.tokens)):
            return []  # tokens not kept (the table started over elsewhere): the cache is taken as it is
        return seq.tokens[computed - seq.start : start - seq.start]

    def _forward(self, ids: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray, table):
        batch = StepBatch.build(
            ids, query_lens, context_lens, table, self.block_size, self.device, num_blocks=self.num_blocks
        )
        return self.model(batch.input_ids, batch.positions, self.attention.context(batch), self.kv_caches)

    def _remember(self, inputs, segments, starts, ends, drafting, drafts) -> None:
        """Each sequence's draft KV now ends at its own tokens' end, plus the proposals it ran through the
        draft (all but its last); its inputs are kept for the next step's catch-up."""
        proposed = dict(zip(drafting.tolist(), range(len(drafting)), strict=True))
        for i, seg in enumerate(segments):
            tokens, computed = seg.tolist(), int(ends[i])
            if i in proposed:
                n = int(inputs.draft_counts[i])
                tokens += drafts[proposed[i], :n].tolist()
                computed += n - 1
            if inputs.sequences is not None:  # kept on the worker's record of the sequence
                inputs.sequences[i].draft = _DraftSequence(computed, int(starts[i]), tokens)


def _progress(inputs, i: int) -> _DraftSequence | None:
    """What the draft computed of batch row i's sequence so far (None: nothing, or a step of no real
    sequences)."""
    return None if inputs.sequences is None else inputs.sequences[i].draft
