"""A worker compiles its attention kernels on a thread while the weights load (shard_worker/warm_up.py):
the full warm-up and the steps after it then compile nothing, and the tokens are the reference
attention's."""

from __future__ import annotations

import numpy as np
import torch
from torch._dynamo.utils import counters

from common.sampling import SamplingConfig
from shard_worker.capacity import synthetic_step
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit
from shard_worker.warm_up import attention_kinds

torch.set_flush_denormal(True)


def greedy_tokens(runner: ModelRunner) -> list[int]:
    """One step of a prompt and two decodes, sampled greedily: its tokens."""
    runner.allocate_kv_cache(40, 16)
    step, _ = synthetic_step([(30, 30), (1, 100), (1, 17)], 16, sample=True)
    step.input_ids[:] = np.arange(len(step.input_ids)) % 50 + 3
    greedy = SamplingConfig(temperature=0.0)
    states = [
        runner.sampler.new_state(SequenceInit(s, greedy, 0, [5] * c, c - int(q == 1), int(q == 1)))
        for s, q, c in zip(step.seq_ids, step.query_lens, step.context_lens, strict=True)
    ]
    return list(runner.execute(step, states).token_ids)


def test_kernels_compiled_while_loading_serve_the_warm_up_and_later_steps(tiny_model):
    torch._dynamo.reset()  # forget kernels compiled by earlier tests: the thread must build them
    before = counters["stats"]["unique_graphs"]
    cpu = torch.device("cpu")
    # flex: the backend whose kernels compile at start-up.
    runner = ModelRunner(
        tiny_model, torch.float32, cpu, TensorParallel(), attention_backend="flex", warm_kernels=True
    )
    kernels = runner.kernel_warm_up
    assert kernels is not None
    kernels.wait()
    assert kernels.error is None and kernels.seconds > 0
    compiled = counters["stats"]["unique_graphs"] - before
    assert compiled >= 2, "the thread compiled no kernel (both tilings of the one layer kind)"

    runner.warm_up(16)
    assert counters["stats"]["unique_graphs"] - before == compiled, "the warm-up compiled again"
    tokens = greedy_tokens(runner)
    assert counters["stats"]["unique_graphs"] - before == compiled, "a step compiled a kernel"

    # The kernels the thread built attend as the per-sequence reference does (scale included: the
    # thread specialises it).
    reference = ModelRunner(tiny_model, torch.float32, cpu, TensorParallel(), attention_backend="reference")
    assert reference.kernel_warm_up is None
    assert greedy_tokens(reference) == tokens


def test_one_layer_per_kind_is_warmed(tiny_model):
    runner = ModelRunner(tiny_model, torch.float32, torch.device("cpu"), TensorParallel())
    kinds = attention_kinds(runner.model)
    assert len(kinds) == 1  # every layer of the tiny Llama has the same heads, scale and no window
    kinds[0].sliding_window = 8  # a windowed layer is another kernel
    assert len(attention_kinds(runner.model)) == 2


def test_the_default_cpu_backend_is_warmed_too(tiny_model):
    """The cpu backend compiles nothing at start-up; the thread runs its kernel and SDPA paths over the
    same steps without an error, and the tokens are the reference attention's."""
    runner = ModelRunner(tiny_model, torch.float32, torch.device("cpu"), TensorParallel(), warm_kernels=True)
    assert runner.attention.name == "cpu"
    runner.warm_up(16)
    assert runner.kernel_warm_up.error is None
    reference = ModelRunner(
        tiny_model, torch.float32, torch.device("cpu"), TensorParallel(), attention_backend="reference"
    )
    assert greedy_tokens(reference) == greedy_tokens(runner)
