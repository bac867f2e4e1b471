"""The review's paths through the step loop (issue 39): a rank-0 reply checked whole before the scheduler
changes (a malformed one is a lost rank), only unfit ranks failing requests, every task supervised.
Fake worker group, no processes."""

from __future__ import annotations

import asyncio

import pytest

from common.pb.tpserve.internal.v1 import worker_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_NOT_FOUND
from scheduler import engine as engine_module
from scheduler import ranks as ranks_module
from scheduler import router_side
from scheduler.tasks import first_to_end
from tests.unit.engine_harness import VOCAB, FakeWorkerGroup, Harness, add_request, expected, run


def _short_logprobs(reply):
    del reply.logprobs[-1]  # reports.py read logprobs[i] past the end: IndexError after update


def _short_top(reply):
    del reply.top_token_ids[-1]  # a strict zip in reports.py: ValueError, taken for unfit ranks


def _token_beyond_vocab(reply):
    reply.token_ids[0] = VOCAB


def _unknown_grammar_seq(reply):
    reply.grammar_ready_seq_ids.append(10**9)


def _nan_forward(reply):
    reply.forward_seconds = float("nan")


def _short_prompt_rows(reply):
    del reply.prompt_logprobs[-1]  # reports.py read prompt_logprobs[row] past the end: IndexError


def _short_prompt_top(reply):
    del reply.prompt_top_token_ids[-1]


@pytest.mark.parametrize(
    "mangle,first_step",
    [
        (_short_logprobs, False),
        (_short_top, False),
        (_token_beyond_vocab, False),
        (_unknown_grammar_seq, False),
        (_nan_forward, False),
        (_short_prompt_rows, True),
        (_short_prompt_top, True),
    ],
)
def test_a_malformed_reply_is_a_lost_rank_and_every_token_and_logprob_comes_once(
    mangle, first_step, monkeypatch
):
    """Before, a short logprob array raised IndexError in the report after Scheduler.update had run: it
    escaped the step loop and the scheduler process exited with every request in flight."""
    monkeypatch.setattr(ranks_module, "LOST_RETRY_S", 0.01)

    async def go():
        group = FakeWorkerGroup()
        async with Harness(group) as h:
            group.gate = asyncio.Semaphore(0)
            prompts = {f"r{i}": [9 + i] * (4 + i) for i in range(3)}
            asks = dict(top_logprobs=2, want_prompt_logprobs=True, prompt_logprobs=1)
            for rid, prompt in prompts.items():
                h.engine.add(add_request(rid, prompt, 6, **asks), h.stream)
            group.mangle = {group.steps + (1 if first_step else 3): mangle}
            gate, group.gate = group.gate, None
            for _ in range(100):
                gate.release()
            await h.wait(lambda: all(h.finished(r) for r in prompts))
            assert group.connects == 2  # the reply was a lost rank: the group was rebuilt once
            for rid, prompt in prompts.items():
                outputs = h.outputs(rid)
                assert not any(o.error for o in outputs)
                assert h.tokens(rid) == expected(prompt, 6)  # each token once, in order
                logprobs = [lp for o in outputs for lp in o.logprobs]
                assert [lp.chosen.token_id for lp in logprobs] == h.tokens(rid)
                assert all(len(lp.top) == 2 for lp in logprobs)
                prompt_rows = [lp for o in outputs for lp in o.prompt_logprobs]
                assert [lp.chosen.token_id for lp in prompt_rows] == prompt[1:]  # each once
            snap = h.engine.snapshot()
            assert snap.kv_blocks_free == snap.kv_blocks_total

    run(go())


def test_a_bug_in_the_step_loop_is_not_taken_for_unfit_ranks(monkeypatch):
    """Before, any ValueError in the loop (a strict zip, the block manager) failed every request with
    "the replica's shard workers cannot serve" and the loop went on over state of unknown consistency.
    Now only UnfitRanks does that: a bug ends the engine with its own error, named by its task."""
    calls = []

    def broken(result):
        calls.append(result)
        raise ValueError("zip() argument 2 is shorter than argument 1")

    monkeypatch.setattr(engine_module, "step_outputs", broken)

    async def go():
        async with Harness() as h:
            h.engine.add(add_request("r0", [5] * 6, 4), h.stream)
            await h.wait(lambda: h.task.done())
            error = h.task.exception()
            assert isinstance(error, ValueError) and "shorter" in str(error)
            assert "(in the scheduler's step loop task)" in error.__notes__
            assert not any(o.error for o in h.outputs("r0"))  # not failed as "cannot serve"
            assert len(calls) == 1

    run(go())


def test_a_failing_heartbeat_ends_the_process_instead_of_stopping_silently(monkeypatch):
    """Before, the load-report task was never awaited: its first exception stopped the reports and the
    routers took a live replica for dead. Every task of the scheduler now runs under first_to_end (the
    process's, scheduler/server.py): its failure ends them all, with its name."""
    monkeypatch.setattr(router_side, "LOAD_REPORT_INTERVAL_S", 0.01)

    async def go():
        async with Harness() as h:

            def broken(**_):
                raise IndexError("list index out of range")

            monkeypatch.setattr(h.engine, "_report", broken)
            never = asyncio.Event()
            with pytest.raises(IndexError) as e:
                await first_to_end({"load reports": h.engine.heartbeat(), "signal": never.wait()})
            assert "(in the scheduler's load reports task)" in e.value.__notes__

    run(go())


def test_first_to_end_cancels_the_others_and_names_the_one_that_returned():
    cancelled = []

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.append(True)

    async def soon():
        await asyncio.sleep(0)

    async def go():
        return await first_to_end({"a": forever(), "b": soon(), "c": forever()})

    assert run(go()) == "b" and cancelled == [True, True]


def test_a_reply_of_another_step_shape_names_the_field():
    """check_reply's message names the field and both sizes, for the log line of the lost rank."""
    from scheduler.plan import ScheduledSeq, SchedulerOutput
    from scheduler.replies import MalformedReply, sampled_tokens
    from scheduler.sequence import Sequence

    seq = Sequence(0, "r", [3, 4, 5], 3, 4, top_logprobs=1)
    out = SchedulerOutput(scheduled=[ScheduledSeq(seq, 3, 1)])
    good = worker_pb2.StepResponse(
        token_counts=[1], token_ids=[7], logprobs=[-0.1], top_token_ids=[7], top_logprobs=[-0.1]
    )
    assert sampled_tokens(out, good, VOCAB, 1) == [[7]]
    bad = worker_pb2.StepResponse(token_counts=[1], token_ids=[7], logprobs=[], top_token_ids=[7])
    with pytest.raises(MalformedReply, match="0 logprobs where the step implies 1"):
        sampled_tokens(out, bad, VOCAB, 1)


def test_an_adapter_whose_files_vanished_fails_its_requests_not_the_rank():
    """Before, a step read an evicted adapter from disk on every rank; if its files were gone the step
    raised and the rank exited (and, named in --lora-modules, could not start again). Now a request on an
    adapter waits until every rank has prefetched it; NOT_FOUND from a rank fails the requests on it,
    naming it, and an adapter a step could not read (lora_errors) fails its requests, not the rank."""

    async def go():
        group = FakeWorkerGroup()
        loras = dict(enable_lora=True, lora_modules=("sql=/a/sql", "gone=/a/gone"))
        async with Harness(group, **loras) as h:
            group.unreadable["gone"] = "LoRA adapter 'gone' (/a/gone): expected adapter_config.json"
            h.engine.add(add_request("g", [5] * 6, 4, lora_name="gone"), h.stream)
            h.engine.add(add_request("s", [6] * 6, 4, lora_name="sql"), h.stream)
            h.engine.add(add_request("b", [7] * 6, 4), h.stream)
            await h.wait(lambda: all(h.finished(r) for r in "gsb"))
            [error] = h.outputs("g")
            assert error.error_code == ERROR_CODE_NOT_FOUND and "'gone'" in error.error
            assert h.tokens("s") == expected([6] * 6, 4) and h.tokens("b") == expected([7] * 6, 4)
            assert group.prefetched == ["gone", "sql"] and group.connects == 1

            # Files gone after the prefetch: the step reports it, its requests fail and the rest go on.
            group.gate = asyncio.Semaphore(0)
            h.engine.add(add_request("s2", [6] * 6, 8, lora_name="sql"), h.stream)
            h.engine.add(add_request("b2", [7] * 6, 8), h.stream)
            report = worker_pb2.LoRAError(lora_name="sql", message="LoRA adapter 'sql' (/a/sql): gone")
            group.mangle = {group.steps + 3: lambda reply: reply.lora_errors.append(report)}
            gate, group.gate = group.gate, None
            for _ in range(100):
                gate.release()
            await h.wait(lambda: h.finished("s2") and h.finished("b2"))
            [error] = [o for o in h.outputs("s2") if o.error]
            assert error.error_code == ERROR_CODE_NOT_FOUND and "'sql'" in error.error
            assert h.tokens("s2") == expected([6] * 6, 8)[: len(h.tokens("s2"))]  # none of the base's
            assert h.tokens("b2") == expected([7] * 6, 8) and group.connects == 1
            snap = h.engine.snapshot()
            assert snap.kv_blocks_free == snap.kv_blocks_total

    run(go())


def test_lora_settings_that_differ_refuse_the_start_in_one_line():
    from scheduler.capacity import UnfitRanks
    from scheduler.lora_admin import check_lora_settings

    def rank(**kw):
        fields = dict(enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4, lora_modules=["a=/x"])
        return worker_pb2.DescribeResponse(**(fields | kw))

    check_lora_settings(True, ("a=/y",), 4, [rank(), rank()])  # paths may differ between hosts
    check_lora_settings(False, (), 4, [worker_pb2.DescribeResponse()])
    for scheduler, ranks, words in [
        ((True, ("a=/x",), 2), [rank()], "--max-loras 2"),
        ((True, ("a=/x", "b=/z"), 4), [rank()], "['a', 'b']"),
        ((True, ("a=/x",), 4), [worker_pb2.DescribeResponse()], "on the workers False"),
        ((False, (), 4), [rank()], "here --enable-lora False"),
        ((True, ("a=/x",), 4), [rank(), rank(max_lora_rank=8)], "rank 1"),
    ]:
        with pytest.raises(UnfitRanks) as e:
            check_lora_settings(*scheduler, ranks)
        assert words in str(e.value) and "\n" not in str(e.value)
