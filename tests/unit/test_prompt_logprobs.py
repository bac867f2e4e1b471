"""Prompt logprobs through the real scheduler, step builder and worker in one process (tiny model, float64),
against transformers' log_softmax: every prompt token after the first gets its logprob, its rank and its
alternatives, a prompt chunked over several steps included, none twice after a recompute preemption; a
sequence asking for them takes nothing from the prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from common.pb.tpserve.internal.v1 import worker_pb2
from common.pb.tpserve.v1 import generation_pb2 as pb
from scheduler.batch import StepBuilder
from scheduler.block_manager import BlockManager
from scheduler.replies import sampled_tokens
from scheduler.reports import StepResult, step_outputs
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.servicer import worker_step
from shard_worker.worker import Worker

BS = 4
PROMPT = [5, 17, 33, 2, 48, 9, 77, 120, 64, 3, 250, 31, 8]
TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_model):
    hf = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].double(), dim=-1)


@pytest.fixture
def worker(tiny_model):
    w = Worker(ModelRunner(tiny_model, torch.float64, torch.device("cpu"), TensorParallel()))
    w.init_cache(64, BS, 0, 256)
    return w


def response(worker: Worker, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
    out = worker.step(worker_step(req))
    return worker_pb2.StepResponse(
        token_counts=out.token_counts,
        token_ids=out.token_ids,
        prompt_logprobs=out.prompt_logprobs,
        prompt_ranks=out.prompt_ranks,
        prompt_top_token_ids=out.prompt_top_token_ids,
        prompt_top_logprobs=out.prompt_top_logprobs,
    )


def run(worker, sched, builder, steps=50, preempt_at=None) -> list[pb.Logprobs]:
    got = []
    for i in range(steps):
        if not sched.has_unfinished:
            break
        if i == preempt_at:
            victim = sched.running[-1]
            sched.running.remove(victim)
            sched._release(victim)
            victim.num_computed_tokens = 0
            victim.status = victim.status.WAITING
            sched.waiting.appendleft(victim)
        out = sched.schedule()
        reply = response(worker, builder.build(out))
        updates = sched.update(out, sampled_tokens(out, reply))
        for o in step_outputs(StepResult(out, updates, [reply], 0.0)):
            got.extend(o.prompt_logprobs)
        sched.check_invariants()
    return got


@pytest.mark.parametrize("budget,preempt_at", [(64, None), (5, None), (5, 2)])
def test_prompt_logprobs_match_transformers(worker, reference, budget, preempt_at):
    policy = SchedulingPolicy(max_model_len=256, max_num_batched_tokens=budget)
    sched = Scheduler(policy, BlockManager(64, BS), [1])
    sched.add(Sequence(0, "r", list(PROMPT), len(PROMPT), 3, ignore_eos=True, prompt_logprobs=TOP))
    got = run(worker, sched, StepBuilder(), preempt_at=preempt_at)
    assert [lp.chosen.token_id for lp in got] == PROMPT[1:]  # each once, in order, from the second on
    for p, lp in enumerate(got):
        row = reference[p]
        assert lp.chosen.logprob == pytest.approx(float(row[PROMPT[p + 1]]), rel=1e-6, abs=1e-5)
        assert lp.chosen.rank == int((row > row[PROMPT[p + 1]]).sum()) + 1
        values, ids = row.topk(TOP)
        assert [t.token_id for t in lp.top] == ids.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(values.tolist(), rel=1e-6, abs=1e-5)
        assert [t.rank for t in lp.top] == [1, 2, 3]


def test_prompt_logprobs_skip_the_prefix_cache(worker):
    sched = Scheduler(
        SchedulingPolicy(max_model_len=256), BlockManager(64, BS, enable_prefix_caching=True), [1]
    )
    builder = StepBuilder()
    sched.add(Sequence(0, "warm", list(PROMPT), len(PROMPT), 2, ignore_eos=True))
    run(worker, sched, builder)
    sched.add(cached := Sequence(1, "cached", list(PROMPT), len(PROMPT), 2, ignore_eos=True))
    sched.add(
        asking := Sequence(2, "asking", list(PROMPT), len(PROMPT), 2, ignore_eos=True, prompt_logprobs=0)
    )
    got = run(worker, sched, builder)
    assert cached.num_cached_tokens == 12 and asking.num_cached_tokens == 0
    assert len(got) == len(PROMPT) - 1 and all(not lp.top for lp in got)


def test_a_forgotten_sequence_leaves_nothing_behind_on_the_worker(worker):
    """One record per sequence on the worker (its table row, sampler state, prompt, grammar flag, draft
    progress): when the scheduler says forget, or a new cache comes, all of it goes at once."""
    sched = Scheduler(SchedulingPolicy(max_model_len=256), BlockManager(64, BS), [1])
    builder = StepBuilder()
    for i in range(3):
        sched.add(
            Sequence(i, f"r{i}", list(PROMPT), len(PROMPT), 2 + 3 * i, ignore_eos=True, prompt_logprobs=0)
        )
    for _ in range(4):  # r0 finishes; the others go on
        out = sched.schedule()
        reply = response(worker, builder.build(out))
        sched.update(out, sampled_tokens(out, reply))
    response(worker, builder.build(sched.schedule()))  # carries r0's forget
    assert sorted(worker.sequences) == [1, 2] and worker.tables.rows_in_use == 2
    assert worker.tables.table(worker.sequences[1].row)  # its blocks, in its own row
    worker.init_cache(64, BS, 0, 256)  # a new scheduler session
    assert not worker.sequences and worker.tables.rows_in_use == 0
