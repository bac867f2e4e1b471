"""Greedy decoding through our ModelRunner and through transformers, for comparing the two.

Drives the runner with tests/test_model_runner.py's helpers (Seq, BlockPool, run_step), so that a change
to the step inputs is made in one place: all prompts prefilled in one step, then one decode step each.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit
from tests.unit.test_model_runner import BLOCK_SIZE, GREEDY, BlockPool, Driver, Seq, run_step

# Prime, so BlockPool's scrambled order (i * 37 % n) is a permutation.
NUM_BLOCKS = 499


def runner_greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """new_tokens greedy tokens per prompt, all prompts batched; EOS does not stop a sequence."""
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    pool = BlockPool(NUM_BLOCKS)
    seqs = [Seq(i, list(p), len(p)) for i, p in enumerate(prompts)]
    driver = Driver(runner)
    driver.add([SequenceInit(s.seq_id, GREEDY, 0, s.tokens, s.prompt_len) for s in seqs])
    run_step(driver, pool, [(s, s.prompt_len) for s in seqs])
    while len(seqs[0].output) < new_tokens:
        run_step(driver, pool, [(s, 1) for s in seqs])
    return [s.output for s in seqs]


def new_runner(model_dir: str | Path, dtype: torch.dtype, attention_backend: str = "auto") -> ModelRunner:
    return ModelRunner(
        model_dir, dtype, torch.device("cpu"), TensorParallel(), attention_backend=attention_backend
    )


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' own generate, one prompt at a time (no padding), EOS ignored."""
    model.generation_config.eos_token_id = None
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def bf16_products(model: torch.nn.Module) -> None:
    """transformers' linear layers computing as ours do with --linear-dtype bfloat16: input and weight
    rounded to bf16 for the product, the product returned in the input's dtype."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.detach().to(torch.bfloat16)
            module.forward = lambda x, w=weight: F.linear(x.to(torch.bfloat16), w).to(x.dtype)
