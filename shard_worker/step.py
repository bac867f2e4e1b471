"""What one model iteration asks of a shard worker and what it answers, as plain values.

The gRPC servicer converts StepRequest/StepResponse protos to and from these, so the model runner
never sees protobuf or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """One iteration. Per-sequence lists are in batch order; per-token lists are flat, each
    sequence's tokens contiguous and in batch order."""

    seq_ids: list[int]
    query_lens: list[int]  # tokens computed this step, per sequence
    context_lens: list[int]  # tokens in the KV cache after this step, per sequence
    do_sample: list[bool]  # sample after this sequence's last position?
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # flat KV slot (block * block_size + offset) per token
    block_table_lens: list[int]
    block_tables: list[int]  # concatenated per sequence


@dataclass
class StepOutputs:
    """Rank 0 fills the sampling fields; other ranks leave them empty."""

    token_ids: list[int] = field(default_factory=list)  # one per sequence with do_sample
    logprobs: list[float] = field(default_factory=list)  # chosen token's, if any sequence asked
    top_token_ids: list[int] = field(default_factory=list)  # per sampled seq, its top_logprobs ids
    top_logprobs: list[float] = field(default_factory=list)
    forward_seconds: float = 0.0
    allreduce_seconds: float = 0.0
