"""What one model iteration asks of a shard worker and what it answers, as plain values.

The gRPC servicer converts StepRequest/StepResponse protos to and from these, so the model runner
never sees protobuf or gRPC.
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


@dataclass
class StepInputs:
    """One iteration, as int64 arrays. Per-sequence arrays are in batch order; per-token arrays are
    flat, each sequence's tokens contiguous and in batch order."""

    seq_ids: np.ndarray  # [S]
    query_lens: np.ndarray  # [S] tokens computed this step
    context_lens: np.ndarray  # [S] tokens in the KV cache after this step
    do_sample: np.ndarray  # [S] sample after this sequence's last position?
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat KV slot (block * block_size + offset) per token
    # [S, B]: row i holds sequence i's block ids (at least ceil(context_len / block_size) of them),
    # padded with 0.
    block_table: np.ndarray

    def __post_init__(self):
        for name in ("seq_ids", "query_lens", "context_lens", "input_ids", "positions", "slot_mapping"):
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        self.do_sample = np.asarray(self.do_sample, dtype=bool)
        self.block_table = np.asarray(self.block_table, dtype=np.int64).reshape(len(self.seq_ids), -1)

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

    token_ids: list[int] = field(default_factory=list)  # one per sequence with do_sample
    logprobs: list[float] = field(default_factory=list)  # chosen token's, if any sequence asked
    top_token_ids: list[int] = field(default_factory=list)  # per sampled seq, its top_logprobs ids
    top_logprobs: list[float] = field(default_factory=list)
    forward_seconds: float = 0.0
    allreduce_seconds: float = 0.0
