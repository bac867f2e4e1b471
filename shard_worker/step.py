"""What one model iteration asks of a shard worker and what it answers, as plain values.

The gRPC servicer converts StepRequest/StepResponse protos to and from these, so the worker and the
model runner never see protobuf or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.sampling import SamplingConfig


@dataclass
class SequenceInit:
    """A sequence the worker has not seen before: how to sample it and its tokens so far."""

    seq_id: int
    sampling: SamplingConfig
    top_logprobs: int
    token_ids: list[int]  # prompt then output so far (for penalties)
    num_prompt_tokens: int
    num_sampled: int = 0  # tokens already sampled: a seeded stream is advanced this many times
    stop_token_ids: tuple[int, ...] = ()  # held back by min_tokens, with the model's EOS ids
    want_prompt_logprobs: bool = False
    prompt_logprobs: int = 0  # alternatives per prompt position, when wanted
    lora_name: str = ""  # the LoRA adapter it runs on; "": the base model
    pooling: bool = False  # its prompt comes whole in one step, which pools it (shard_worker/pooling.py)
    token_type_start: int = 0  # a cross-encoder pair's second text starts here (token type 1); 0: none
    images: tuple = ()  # its prompt's images (shard_worker/images.py PromptImage), in prompt order


@dataclass
class StepInputs:
    """One iteration, as int64 arrays. Per-sequence arrays are in batch order; input_ids is flat, each
    sequence's tokens contiguous and in batch order. Positions and KV slots follow from the lengths and
    the block tables (shard_worker/attention/backend.py, StepBatch.build)."""

    seq_ids: np.ndarray  # [S]
    query_lens: np.ndarray  # [S] tokens computed this step
    context_lens: np.ndarray  # [S] tokens in the KV cache after this step
    # [S] positions sampled, the sequence's last ones: 0 mid-prompt, 1, or 1 + proposals to verify
    sample_counts: np.ndarray
    input_ids: np.ndarray  # [T]
    # [S, B]: row i holds sequence i's block ids (at least ceil(context_len / block_size) of them),
    # padded with 0.
    block_table: np.ndarray
    # Prompt logprobs (rare): the step rows whose logits give them, the prompt token each row predicts,
    # and each row's number of alternatives.
    prompt_rows: np.ndarray | None = None
    prompt_targets: np.ndarray | None = None
    prompt_tops: np.ndarray | None = None
    # [S] tokens the draft model proposes for each sequence before the forward (speculative decoding):
    # the last draft_counts[i] of its query_lens[i], not in input_ids until then. None: zeros.
    draft_counts: np.ndarray | None = None
    # [S] the worker's record of each sequence (worker.py WorkerSequence), where the draft model keeps
    # its progress on it; None for steps of no real sequences (warm-up, profiling).
    sequences: list | None = None
    # Pooling (rare): the batch positions of the sequences pooled this step, and [T] token type ids
    # (None: every token's type is 0).
    pool_index: np.ndarray | None = None
    token_type_ids: np.ndarray | None = None
    # [S] each sequence's recurrent-state slot (linear-attention layers); None: none (a synthetic step
    # then starts every sequence afresh and keeps nothing).
    state_slots: np.ndarray | None = None
    # The other layer groups' tables, shaped as block_table (common/kv_cache_spec.py); empty for a model
    # with one group, or a synthetic step (every layer then reads block_table).
    group_block_tables: list = field(default_factory=list)

    def __post_init__(self):
        for name in ("seq_ids", "query_lens", "context_lens", "sample_counts", "input_ids"):
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        self.block_table = np.asarray(self.block_table, dtype=np.int64).reshape(len(self.seq_ids), -1)
        if self.draft_counts is None or not len(self.draft_counts):
            self.draft_counts = np.zeros(len(self.seq_ids), dtype=np.int64)
        self.draft_counts = np.asarray(self.draft_counts, dtype=np.int64)

    @staticmethod
    def pad_tables(tables: list[list[int]]) -> np.ndarray:
        """[len(tables), longest] with each table in a row, padded with 0."""
        out = np.zeros((len(tables), max((len(t) for t in tables), default=0)), dtype=np.int64)
        for row, table in zip(out, tables, strict=True):
            row[: len(table)] = table
        return out


@dataclass
class StepOutputs:
    """Rank 0 fills the sampling fields; other ranks leave them empty."""

    token_counts: list[int] = field(default_factory=list)  # per sampled sequence, tokens it produced
    token_ids: list[int] = field(default_factory=list)  # those tokens, concatenated
    logprobs: list[float] = field(default_factory=list)  # per token, if any sequence asked
    top_token_ids: list[int] = field(default_factory=list)  # per token of an asking sequence
    top_logprobs: list[float] = field(default_factory=list)
    forward_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    # Rank 0: sequences whose grammar became ready since the last step, and those whose failed.
    grammar_ready_seq_ids: list[int] = field(default_factory=list)
    grammar_errors: list[tuple[int, str]] = field(default_factory=list)
    lora_errors: list[tuple[str, str]] = field(default_factory=list)  # (adapter, why): it did not read
    grammar_mask_seconds: float = 0.0  # host time on grammar masks this step, on the critical path
    grammar_fill_seconds: float = 0.0  # llguidance's mask filling, overlapping the forward
    # Rank 0, per prompt-logprob row: the next prompt token's logprob and rank, then its alternatives.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top_token_ids: list[int] = field(default_factory=list)
    prompt_top_logprobs: list[float] = field(default_factory=list)
    # Rank 0: the pooled vectors of the step's pooling sequences (concatenated) and whose they are.
    pooled: list[float] = field(default_factory=list)
    pooled_seq_ids: list[int] = field(default_factory=list)


@dataclass
class WorkerStep:
    """A StepRequest as plain values: what changed since the last step, then the step itself."""

    step_id: int
    new_sequences: list[SequenceInit]
    forgotten_seq_ids: list[int]
    swap_out: tuple[list[int], list[int]]  # (device blocks, host blocks), copied before the forward
    swap_in: tuple[list[int], list[int]]  # (host blocks, device blocks), copied after the swap out
    seq_ids: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    sample_counts: np.ndarray
    input_ids: np.ndarray
    # Block table changes, per sequence: start over (1) or extend; how many ids of new_block_ids are its.
    table_reset: np.ndarray
    new_block_counts: np.ndarray
    new_block_ids: np.ndarray
    grammar_wait_ms: int = 0  # rank 0 may wait this long for a grammar still compiling
    prompt_logprob_counts: np.ndarray | None = None  # per sequence; None: no sequence wants any
    draft_counts: np.ndarray | None = None  # per sequence; None: the draft model proposes nothing
    # The other layer groups' new table entries, group after group (as many per sequence as
    # new_block_counts says); empty for a model with one group.
    group_new_block_ids: np.ndarray | None = None
    # Linear-attention models: each sequence's state slot, and the step's state copies (as swap_out and
    # swap_in, for slots).
    state_slots: np.ndarray | None = None
    state_swap_out: tuple[list[int], list[int]] = ((), ())
    state_swap_in: tuple[list[int], list[int]] = ((), ())
