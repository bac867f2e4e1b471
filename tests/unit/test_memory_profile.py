"""The memory profile (CUDA) runs the worst step the scheduler can form: the whole token budget, as many
sequences as allowed, every one attending over max_model_len keys. On CPU the cache is the host budget
and the warm-up compiles the kernels; that step then runs on the sized cache without compiling anything
on the request path."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from common.sampling import SamplingConfig
from shard_worker.attention import StepBatch
from shard_worker.capacity import synthetic_step, worst_step
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit

torch.set_flush_denormal(True)


@pytest.mark.parametrize(
    "budget,max_seqs,max_len",
    [(2048, 128, 1024), (200, 24, 300), (32, 128, 2048), (5000, 3, 2048), (10_000, 2, 100), (7, 1, 50)],
)
def test_worst_step_fills_the_budget_and_the_sequence_cap(budget, max_seqs, max_len):
    step, num_blocks = worst_step(16, budget, max_seqs, max_len)
    tokens = min(budget, max_seqs * max_len)
    assert sum(step.query_lens) == len(step.input_ids) == tokens
    assert set(step.context_lens.tolist()) == {max_len}  # everyone attends over the longest context allowed
    assert all(q <= max_len for q in step.query_lens)
    chunks = [q for q in step.query_lens if q > 1]
    # As many sequences as the cap and the budget allow: decodes, plus the fewest chunks for the rest.
    assert len(step.seq_ids) == min(max_seqs, tokens)
    assert len(chunks) <= -(-tokens // max_len)
    # Slots written are distinct and inside the blocks the step says it uses.
    batch = StepBatch.build(
        step.input_ids, step.query_lens, step.context_lens, step.block_table, 16, torch.device("cpu")
    )
    slots = batch.slot_mapping.tolist()
    assert len(set(slots)) == tokens and max(slots) < num_blocks * 16
    assert step.block_table.max() < num_blocks


def test_cpu_capacity_is_the_host_budget_and_warm_up_covers_the_worst_step(tiny_model):
    """On CPU nothing runs to size the cache (the budget is the cache); warm_up then compiles what even
    the worst step needs."""
    torch._dynamo.reset()  # forget kernels compiled by earlier tests: warm_up must compile them
    runner = ModelRunner(tiny_model, torch.float32, torch.device("cpu"), TensorParallel())
    limits = dict(block_size=16, max_num_batched_tokens=200, max_num_seqs=24, max_model_len=300)
    graphs = counters["stats"]["unique_graphs"]
    num_blocks = runner.profile_num_blocks(gpu_memory_utilization=0.9, cpu_kv_cache_gib=0.01, **limits)
    assert counters["stats"]["unique_graphs"] == graphs, "sizing the CPU cache ran a step"
    assert num_blocks == int(0.01 * 2**30) // runner.kv_block_bytes(16)
    runner.warm_up(16)
    runner.allocate_kv_cache(num_blocks, 16)
    step, blocks_used = worst_step(16, 200, 24, 300)
    assert blocks_used <= num_blocks
    assert len(step.seq_ids) == 24 and sum(step.query_lens) == 200
    assert list(step.query_lens).count(1) == 23 and set(step.context_lens.tolist()) == {300}
    # Every sequence samples, so the logits and sampler rows are the most a step can have too.
    greedy = SamplingConfig(temperature=0.0)
    states = [runner.sampler.new_state(SequenceInit(s, greedy, 0, [0] * 300, 300)) for s in step.seq_ids]
    step.sample_counts[:] = 1
    # The warm-up compiled the attention kernels; this step (another cache size) must reuse them.
    graphs = counters["stats"]["unique_graphs"]
    out = runner.execute(step, states)
    assert counters["stats"]["unique_graphs"] == graphs, "the step compiled a kernel: the warm-up did not"
    assert len(out.token_ids) == 24


def test_warm_up_compiles_what_requests_need(tiny_model):
    """For a worker given its KV capacity (no profile): after warm_up, a step of decodes, a long prompt
    chunk and short queries compiles nothing."""
    torch._dynamo.reset()
    runner = ModelRunner(tiny_model, torch.float32, torch.device("cpu"), TensorParallel())
    runner.allocate_kv_cache(40, 16)
    runner.warm_up(16)
    step, _ = synthetic_step([(1, 100), (1, 37), (50, 90), (3, 3)], 16)
    graphs = counters["stats"]["unique_graphs"]
    runner.execute(step)
    assert counters["stats"]["unique_graphs"] == graphs


class FakeCudaMemory:
    """The CUDA allocator's figures, for a profile: weights 1 GiB, the scratch cache and the step's
    activations added by what the runner allocates (as on a device)."""

    def __init__(self):
        self.total, self.free, self.allocated_bytes, self.peak = 80 << 30, 70 << 30, 1 << 30, 1 << 30

    def allocated(self):
        return self.allocated_bytes

    def max_allocated(self):
        return self.peak

    def reset_peak(self):
        self.peak = self.allocated_bytes


def test_the_cuda_budget_does_not_count_the_scratch_cache():
    """The worst step's scratch KV cache is replaced by the real cache, so it must not shrink the real
    one's budget (it did by ~1.5 GiB at Llama-3-8B, 8k context)."""
    from shard_worker.capacity import kv_budget

    mem = FakeCudaMemory()
    weights = mem.allocated()
    mem.allocated_bytes += 3 << 30  # the scratch cache, allocated by the profile's step
    base = mem.allocated()
    mem.reset_peak()
    mem.peak = base + (2 << 30)  # the step's activations at their peak
    step_peak = mem.max_allocated() - base
    budget = kv_budget(mem.total, 0.9, outside_torch=4 << 30, allocated=weights, step_peak=step_peak)
    assert budget == int((80 << 30) * 0.9) - (4 << 30) - (1 << 30) - (2 << 30)
