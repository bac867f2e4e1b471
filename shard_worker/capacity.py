"""What sizes and warms a rank's KV cache: the synthetic steps it runs (the worst one the scheduler can
form, which CUDA profiles; the shapes a first request brings, which warm-up runs), and the CUDA budget.
Plain figures in, StepInputs out; the runner (model_runner.py) runs them."""

from __future__ import annotations

import torch

from shard_worker.step import StepInputs


def worst_step(
    block_size: int, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> tuple[StepInputs, int]:
    """The step needing the most memory that the scheduler can form, and the KV blocks it uses: the whole
    token budget over as many sequences as allowed, each attending over max_model_len keys, i.e. decodes
    at max_model_len plus prefill chunks (as few as fit, each ending at max_model_len) for the rest."""
    tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    decodes = min(max_num_seqs - 1, tokens - 1)
    while decodes + -(-(tokens - decodes) // max_model_len) > max_num_seqs:
        decodes = max_num_seqs - -(-(tokens - decodes) // max_model_len)
    rest = tokens - decodes
    chunks = [min(max_model_len, rest - start) for start in range(0, rest, max_model_len)]
    return synthetic_step([(1, max_model_len)] * decodes + [(q, max_model_len) for q in chunks], block_size)


def synthetic_step(
    lens: list[tuple[int, int]], block_size: int, sample: bool = False
) -> tuple[StepInputs, int]:
    """A step of (query_len, context_len) sequences of token 0, sampling nothing (with sample, each
    samples its last position), and the blocks it uses.
    The sequences' cached blocks are one shared prefix (attention reads the cache in place, so sharing
    changes nothing it does, and the cache stays small); the blocks a sequence writes are its own."""
    shared = -(-max(c for _, c in lens) // block_size)
    tables = []
    next_block = shared
    for q, c in lens:
        first_written = (c - q) // block_size
        num_written = -(-c // block_size) - first_written
        tables.append(list(range(first_written)) + list(range(next_block, next_block + num_written)))
        next_block += num_written
    step = StepInputs(
        seq_ids=range(len(lens)),
        query_lens=[q for q, _ in lens],
        context_lens=[c for _, c in lens],
        sample_counts=[int(sample)] * len(lens),
        input_ids=[0] * sum(q for q, _ in lens),
        block_table=StepInputs.pad_tables(tables),
    )
    return step, next_block


def kv_budget(total: int, utilization: float, outside_torch: int, allocated: int, step_peak: int) -> int:
    """Bytes left for the KV cache on a CUDA device: the share of its memory we may fill, less what
    others hold, what we hold (weights) and the worst step's transient peak."""
    return int(total * utilization) - outside_torch - allocated - step_peak


class CudaMemory:
    """The CUDA allocator's figures for one device, behind methods a test can fake."""

    def __init__(self, device: torch.device):
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
