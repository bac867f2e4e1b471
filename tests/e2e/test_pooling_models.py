"""Every pooling family and mode (tests/pooling_models.py: BERT with cls, mean, max and last-token pooling,
XLM-R, a BERT cross-encoder with token types, a three-label BERT classifier, Qwen3 and Llama decoders
pooled, a Qwen3 sequence classifier (Qwen3-Reranker's converted shape: its last token's score), BERT with
a sentence-transformers Dense module between pooling and Normalize) run by the shard worker's model
runner, at one rank and at two ranks in real processes over torch.distributed (gloo), against transformers
in float32 pooled as sentence-transformers pools: cosine >= 0.99999. Several prompts of different lengths
in one step, as the scheduler batches them (two close enough in length to share one padded attention
group: shard_worker/model/bert.py's EncoderPlan)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.pooling import token_types
from shard_worker.step import StepInputs
from tests.pooling_models import KINDS, VOCAB, build, reference
from tests.two_ranks import run_two_ranks

BLOCK = 16


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[2, *(rng.randrange(5, VOCAB) for _ in range(n)), 3] for n in (1, 14, 40, 70, 60)]


def type_starts(kind: str) -> list[int]:
    """A cross-encoder's pairs: the second text from the middle of each prompt on."""
    return [len(p) // 2 if kind == "bert-cross" else 0 for p in prompts()]  # bert-classify: single texts


def pooled(model_dir: str, kind: str, tp: TensorParallel) -> torch.Tensor | None:
    """The vectors of every prompt, pooled in one step (rank 0; None elsewhere)."""
    runner = ModelRunner(model_dir, torch.float32, torch.device("cpu"), tp, runner="pooling")
    ps = prompts()
    runner.allocate_kv_cache(64, BLOCK)
    tables, first = [], 0
    for p in ps:
        n = -(-len(p) // BLOCK)
        tables.append(list(range(first, first + n)))
        first += n
    lens = [len(p) for p in ps]
    step = StepInputs(
        seq_ids=range(len(ps)),
        query_lens=lens,
        context_lens=lens,
        sample_counts=[0] * len(ps),
        input_ids=sum(ps, []),
        block_table=StepInputs.pad_tables(tables),
    )
    step.pool_index = np.arange(len(ps))
    step.token_type_ids = token_types(step.query_lens, step.pool_index, type_starts(kind))
    out = runner.execute(step)
    return torch.tensor(out.pooled).view(len(ps), -1) if tp.rank == 0 else None


def _pooled_each(tp: TensorParallel, models: dict[str, str]):
    for kind, model_dir in models.items():
        yield kind, pooled(model_dir, kind, tp)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pooling")
    return {kind: str(build(kind, root / kind)) for kind in KINDS}


@pytest.fixture(scope="module")
def two_ranks(models) -> dict[str, torch.Tensor]:
    return run_two_ranks(_pooled_each, (models,), len(models))


def expected(model_dir: str, kind: str) -> torch.Tensor:
    types = [
        [0] * s + [1] * (len(p) - s) if s else None for p, s in zip(prompts(), type_starts(kind), strict=True)
    ]
    return reference(model_dir, prompts(), types if kind == "bert-cross" else None).float()


@pytest.mark.parametrize("kind", list(KINDS))
def test_pooled_vectors_equal_transformers(kind, models, two_ranks, one_thread):
    torch.set_flush_denormal(True)
    want = expected(models[kind], kind)
    for tp_size, got in ((1, pooled(models[kind], kind, TensorParallel())), (2, two_ranks[kind])):
        assert got.shape == want.shape, f"TP {tp_size}"
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert cosine.min().item() >= 0.99999, f"{kind} at TP {tp_size}: cosine {cosine.tolist()}"
        if KINDS[kind][0].endswith("ForSequenceClassification"):  # scores, logits: the values themselves
            assert got.flatten().tolist() == pytest.approx(want.flatten().tolist(), abs=1e-5)
