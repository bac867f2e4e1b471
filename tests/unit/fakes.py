"""Small helpers the plain-Python scheduler tests share."""

from __future__ import annotations

import numpy as np

ARRAY_FIELDS = (
    "seq_ids",
    "query_lens",
    "context_lens",
    "sample_counts",
    "input_ids",
    "table_reset",
    "new_block_counts",
    "new_block_ids",
)


def one_each(tokens: list[int]) -> list[list[int]]:
    """A one-token-per-sequence step's answer, as Scheduler.update takes it."""
    return [[t] for t in tokens]


def step_arrays(req) -> dict[str, list[int]]:
    """A StepRequest's packed arrays as lists."""
    return {name: np.frombuffer(getattr(req, name), dtype="<i8").tolist() for name in ARRAY_FIELDS}


def kv_slot(table: list[int], position: int, block_size: int) -> int:
    """The flat KV slot of a sequence's token at this position, as a fake worker addresses its cache (the
    workers' own derivation is shard_worker/attention/backend.py's StepBatch.build, tested against this
    formula written out by hand)."""
    return table[position // block_size] * block_size + position % block_size
