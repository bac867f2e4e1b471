"""Two ranks in real processes over torch.distributed (gloo) give the same greedy tokens and logprobs as
one rank, on the tiny model and on a tiny model with a single KV head (replicated on both ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common.sampling import SamplingConfig
from shard_worker.model.builder import build_model
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit, StepInputs
from tests.two_ranks import run_two_ranks

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 16
PROMPTS = [[0, 11, 305, 72, 9], [0, 400, 3], [0, *range(500, 520)]]  # the last is prefilled in two chunks
STEPS = 8
TOP = 3  # logprobs alternatives asked for, to compare numbers and not only argmaxes


def run_greedy(runner: ModelRunner, tp: TensorParallel) -> tuple[list[list[int]], list[list[float]]]:
    """Drives the runner like a scheduler would; rank 0's sampled tokens are broadcast so every rank
    plans the same next step (the scheduler's job in the real system)."""
    runner.allocate_kv_cache(BLOCKS_PER_SEQ * len(PROMPTS), BLOCK_SIZE)
    greedy = SamplingConfig(temperature=0.0)
    states = None
    if runner.sampler is not None:
        states = [
            runner.sampler.new_state(SequenceInit(i, greedy, TOP, p, len(p))) for i, p in enumerate(PROMPTS)
        ]
    tokens = [list(p) for p in PROMPTS]
    computed = [0] * len(PROMPTS)
    logprobs: list[list[float]] = [[] for _ in PROMPTS]
    for step in range(STEPS):
        lists = {name: [] for name in ("seq_ids", "query_lens", "context_lens", "sample_counts", "input_ids")}
        tables = []
        for i, toks in enumerate(tokens):
            n = len(toks) - computed[i]
            if step == 0 and i == len(PROMPTS) - 1:
                n //= 2
            lists["seq_ids"].append(i)
            lists["query_lens"].append(n)
            lists["context_lens"].append(computed[i] + n)
            lists["sample_counts"].append(int(computed[i] + n == len(toks)))
            lists["input_ids"] += toks[computed[i] : computed[i] + n]
            tables.append(list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)))
            computed[i] += n
        inp = StepInputs(**lists, block_table=StepInputs.pad_tables(tables))
        sampled = [i for i, s in zip(inp.seq_ids, inp.sample_counts, strict=True) if s]
        out = runner.execute(inp, None if states is None else [states[i] for i in sampled])
        if tp.rank != 0:
            assert out.token_ids == [] and out.logprobs == []
        new = torch.tensor(out.token_ids if tp.rank == 0 else [0] * len(sampled))
        if tp.world_size > 1:
            dist.broadcast(new, src=0)
        for k, (i, token) in enumerate(zip(sampled, new.tolist(), strict=True)):
            tokens[i].append(token)
            if tp.rank == 0:
                logprobs[i] += [out.logprobs[k], *out.top_logprobs[TOP * k : TOP * (k + 1)]]
    return [t[len(p) :] for t, p in zip(tokens, PROMPTS, strict=True)], logprobs


def _greedy_on_each(tp: TensorParallel, model_dirs: list[str]):
    for model_dir in model_dirs:
        yield model_dir, run_greedy(ModelRunner(model_dir, torch.float64, torch.device("cpu"), tp), tp)


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory) -> Path:
    return build_model("tiny", tmp_path_factory.mktemp("tiny-1kv"), num_kv_heads=1)


@pytest.fixture(scope="module")
def two_rank_results(tiny_model, one_kv_head_model) -> dict:
    """Runs both models in one pair of processes (spawning is the slow part)."""
    model_dirs = [str(tiny_model), str(one_kv_head_model)]
    return run_two_ranks(_greedy_on_each, (model_dirs,), len(model_dirs))


def single_rank(model_dir) -> tuple[list[list[int]], list[list[float]]]:
    tp = TensorParallel()
    return run_greedy(ModelRunner(model_dir, torch.float64, torch.device("cpu"), tp), tp)


@pytest.mark.parametrize("which", ["tiny", "one_kv_head"])
def test_two_ranks_match_one(which, tiny_model, one_kv_head_model, two_rank_results):
    model_dir = tiny_model if which == "tiny" else one_kv_head_model
    tokens, logprobs = two_rank_results[str(model_dir)]
    want_tokens, want_logprobs = single_rank(model_dir)
    assert tokens == want_tokens
    assert all(len(t) == STEPS - (i == len(PROMPTS) - 1) for i, t in enumerate(tokens))
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-9)
