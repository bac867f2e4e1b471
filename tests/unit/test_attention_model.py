"""The tiny model in float32 (the compiled attention path; tests/test_model_runner.py covers float64, which
takes the per-sequence path) against transformers: every computed position's logits, over steps that
mix whole prompts, a prompt chunked over two steps and decodes, with scrambled blocks."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaForCausalLM

from shard_worker.attention import StepBatch
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import StepInputs

torch.set_flush_denormal(True)

BLOCK_SIZE = 16
NUM_BLOCKS = 64


def test_float32_steps_match_transformers(tiny_model):
    runner = ModelRunner(tiny_model, torch.float32, torch.device("cpu"), TensorParallel())
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert runner.attention.name == "cpu"  # auto's choice on CPU: the C++ kernel
    reference = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    # Whole sequences up front: each step computes some of their positions, as the scheduler would.
    tokens = {
        s: [0] + [(s * 131 + i * 97) % 1000 + 2 for i in range(n - 1)] for s, n in [(0, 23), (1, 42), (2, 7)]
    }
    free = [(i * 37) % NUM_BLOCKS for i in range(NUM_BLOCKS)]
    blocks: dict[int, list[int]] = {s: [] for s in tokens}
    done = dict.fromkeys(tokens, 0)
    steps = [
        {0: 21, 1: 16, 2: 5},  # two whole prompts and a first chunk
        {0: 1, 1: 24, 2: 1},  # decodes and the rest of the chunked prompt
        {0: 1, 1: 1, 2: 1},
        {1: 1},
    ]
    for step in steps:
        ids, q_lens, c_lens = [], [], []
        for s, n in step.items():
            start, end = done[s], done[s] + n
            while len(blocks[s]) * BLOCK_SIZE < end:
                blocks[s].append(free.pop())
            ids += tokens[s][start:end]
            q_lens.append(n)
            c_lens.append(end)
        table = StepInputs.pad_tables([blocks[s] for s in step])
        batch = StepBatch.build(
            np.array(ids), np.array(q_lens), np.array(c_lens), table, BLOCK_SIZE, runner.device
        )
        with torch.inference_mode():
            hidden = runner.model(
                batch.input_ids, batch.positions, runner.attention.context(batch), runner.kv_caches
            )
            logits = runner.model.compute_logits(hidden)
        row = 0
        for s, n in step.items():
            with torch.no_grad():
                want = reference(torch.tensor([tokens[s][: done[s] + n]])).logits[0, done[s] :]
            torch.testing.assert_close(logits[row : row + n], want, rtol=1e-4, atol=1e-4)
            row += n
            done[s] += n
