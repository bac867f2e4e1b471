"""Sampling on rank 0: logits processors (processors.py), the draw (draw.py), and the sampler that
runs them over a step's sampled rows, one or several per sequence (sampler.py)."""

from shard_worker.sampling.processors import LogitsProcessor, SequenceState
from shard_worker.sampling.sampler import Sampler, SampleResult

__all__ = ["LogitsProcessor", "SampleResult", "Sampler", "SequenceState"]
