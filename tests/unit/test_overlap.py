"""Async scheduling (scheduler/overlap.py) on the Engine with a fake worker group: the next step planned
and sent while one is in flight, with abort, finish (a stop token, max tokens), preemption (recompute and
swap) and a lost rank meanwhile. The fake computes from a paged KV cache of its own, filled from each
step's input ids at the slots of the block tables the step sends, with the placeholders put in as a rank
does: a wrong input, position or block shows in the tokens. Each case runs the serial loop and the async
one on the same requests: the tokens must be the model's and the same; every block ends free, the
accounting checked after every step."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common.pb.tpserve.internal.v1 import worker_pb2
from common.pb.tpserve.v1 import generation_pb2
from scheduler.config import SchedulerConfig
from scheduler.policy import SchedulingPolicy
from scheduler.speculation import SpeculativePolicy
from scheduler.workers import WorkersLost
from tests.unit.engine_harness import FakeWorkerGroup, Harness, add_request, expected, next_token, run

BLOCK = 16


def arr(data: bytes) -> list[int]:
    return np.frombuffer(data, "<i8").tolist()


class PagedFake(FakeWorkerGroup):
    """One rank whose model reads its KV cache: the next token of a sequence is next_token of the tokens at
    its positions' slots. send() queues a step, receive() answers the oldest, as a rank's stream does."""

    def __init__(self, num_blocks: int = 64, num_host_blocks: int = 0):
        super().__init__(num_blocks, num_host_blocks)
        self.cache: dict[int, int] = {}  # slot -> token
        self.host: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}  # seq id -> the token last sampled for it (rank 0's sampler state)
        self.sent: list[bytes] = []
        self.max_in_flight = 0
        self.placeholders = 0
        self.after_step = lambda: None
        self.grammars: set[int] = set()  # sequences with a grammar (reported compiled at once)
        self.behind_grammar = 0

    async def connect(self, on_lost=lambda: None):
        info = await super().connect(on_lost)
        self.cache.clear(), self.host.clear(), self.tables.clear(), self.last.clear(), self.sent.clear()
        return info

    async def send(self, data: bytes) -> None:
        for queued in self.sent:  # a step sent while one with a grammar sequence is in flight
            self.behind_grammar += bool(
                self.grammars & set(arr(worker_pb2.StepRequest.FromString(queued).seq_ids))
            )
        self.sent.append(data)
        self.max_in_flight = max(self.max_in_flight, len(self.sent))

    async def receive(self, step_id: int):
        try:
            return await self.step(self.sent[0], step_id)
        finally:
            self.sent.pop(0)

    def _copy(self, src: dict, dst: dict, pairs) -> None:
        for a, b in pairs:
            for k in range(BLOCK):
                dst[b * BLOCK + k] = src.get(a * BLOCK + k)

    async def step(self, data: bytes, step_id: int):
        self.steps += 1
        req = worker_pb2.StepRequest.FromString(data)
        for seq_id in req.forgotten_seq_ids:
            self.tables.pop(seq_id, None), self.last.pop(seq_id, None)
            self.forgotten.append(seq_id)
        ready = [i.seq_id for i in req.new_sequences if i.sampling.HasField("structured_output")]
        self.grammars.update(ready)
        if self.gate is not None:
            await self.gate.acquire()
        if self.steps in self.fail_steps:
            raise WorkersLost("rank 0 died mid-step")
        self._copy(self.cache, self.host, zip(req.swap_out_src, req.swap_out_dst, strict=True))
        self._copy(self.host, self.cache, zip(req.swap_in_src, req.swap_in_dst, strict=True))
        ids, new_ids, tokens, at, b_at = arr(req.input_ids), arr(req.new_block_ids), [], 0, 0
        rows = zip(
            *(arr(getattr(req, f)) for f in ("seq_ids", "query_lens", "context_lens", "sample_counts")),
            arr(req.table_reset),
            arr(req.new_block_counts),
            strict=True,
        )
        for seq_id, q, ctx, n, reset, nb in rows:
            table = [] if reset else self.tables[seq_id]
            self.tables[seq_id] = table = table + new_ids[b_at : b_at + nb]
            b_at += nb
            for pos, t in zip(range(ctx - q, ctx), ids[at : at + q], strict=True):
                if t < 0:  # a placeholder: the token sampled for it last step
                    self.placeholders += 1
                    t = self.last[seq_id]
                self.cache[table[pos // BLOCK] * BLOCK + pos % BLOCK] = t
            at += q
            if n:
                self.last[seq_id] = next_token(
                    [self.cache[table[p // BLOCK] * BLOCK + p % BLOCK] for p in range(ctx)]
                )
                tokens.append(self.last[seq_id])
        self.after_step()
        reply = worker_pb2.StepResponse(step_id=step_id, token_ids=tokens, token_counts=[1] * len(tokens))
        reply.grammar_ready_seq_ids.extend(ready)
        return [reply]


def prompts(n: int, base: int = 3) -> dict[str, list[int]]:
    return {f"r{i}": [base + i, 7, base + 2 * i] * (2 + 4 * i) for i in range(n)}


async def serve(requests, group: PagedFake, on_idle=None, **config) -> tuple[dict, Harness]:
    """Runs requests {id: (prompt, max_new, stop ids)} to their end; each request's outputs."""
    async with Harness(group, **config) as h:
        group.after_step = lambda: h.engine.scheduler.check_invariants()
        for rid, (prompt, max_new, stop) in requests.items():
            msg = add_request(rid, prompt, max_new)
            msg.stop_token_ids.extend(stop)
            h.engine.add(msg, h.stream)
        if on_idle is not None:
            await on_idle(h)
        await h.wait(lambda: all(h.finished(r) for r in requests))
        await h.wait(lambda: h.engine.snapshot().in_flight == 0)
        await asyncio.sleep(0.05)  # a step in flight for a finished request returns
        snap = h.engine.snapshot()
        assert snap.kv_blocks_free == snap.kv_blocks_total, "a block was not freed"
        h.engine.scheduler.check_invariants()
        return {r: h.outputs(r) for r in requests}, h


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def check_ends(outputs) -> None:
    """One final output per request, and nothing after it."""
    ends = [i for i, o in enumerate(outputs) if o.finish_reason or o.error]
    assert ends == [len(outputs) - 1], "a token after the end, or no end"


def both(requests, make_group=PagedFake, **config):
    """The serial loop's outputs, the async loop's, and the async run's group."""
    serial, _ = run(serve(requests, make_group(), **config))
    group = make_group()
    overlap, _ = run(serve(requests, group, async_scheduling=True, **config))
    assert group.max_in_flight == 2, "the next step was never sent while one was in flight"
    assert group.placeholders > 0
    return serial, overlap, group


def test_async_outputs_equal_the_serial_loops_and_the_models():
    requests = {r: (p, 5 + 3 * i, ()) for i, (r, p) in enumerate(prompts(6).items())}
    serial, overlap, _ = both(requests, policy=SchedulingPolicy(max_num_batched_tokens=64))
    for rid, (prompt, max_new, _) in requests.items():
        assert tokens_of(overlap[rid]) == tokens_of(serial[rid]) == expected(prompt, max_new)
        assert overlap[rid][-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        check_ends(overlap[rid])


def test_a_stop_token_ends_the_sequence_and_its_token_planned_ahead_is_dropped():
    requests = {}
    for i, (rid, prompt) in enumerate(prompts(4).items()):
        model = expected(prompt, 20)
        requests[rid] = (prompt, 20, (model[2 + 3 * i],))
    serial, overlap, _ = both(requests)
    for rid, (prompt, _, (stop,)) in requests.items():
        model = expected(prompt, 20)
        want = model[: model.index(stop) + 1]
        assert tokens_of(overlap[rid]) == tokens_of(serial[rid]) == want
        assert overlap[rid][-1].finish_reason == generation_pb2.FINISH_REASON_EOS
        check_ends(overlap[rid])


def test_max_tokens_of_one_ends_after_the_prompt():
    requests = {r: (p, 1, ()) for r, p in prompts(3).items()}
    serial, overlap, _ = both({**requests, "long": ([5] * 40, 12, ())})
    for rid, (prompt, _, _) in requests.items():
        assert tokens_of(overlap[rid]) == tokens_of(serial[rid]) == expected(prompt, 1)
        check_ends(overlap[rid])


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_preemption_while_the_next_step_is_planned(swap):
    # 12 blocks for 4 sequences growing to 3 blocks each: the newest are preempted on the way.
    requests = {r: (p[:30], 24, ()) for r, p in prompts(4).items()}

    def group():
        return PagedFake(num_blocks=10, num_host_blocks=16 if swap else 0)

    config = {"swap_space": 0.001} if swap else {}
    serial, overlap, _ = both(requests, group, **config)
    for rid, (prompt, max_new, _) in requests.items():
        assert tokens_of(overlap[rid]) == tokens_of(serial[rid]) == expected(prompt, max_new)
        check_ends(overlap[rid])


def test_preemptions_happen_in_the_async_run():
    requests = {r: (p[:30], 24, ()) for r, p in prompts(4).items()}

    async def go():
        _, h = await serve(requests, PagedFake(num_blocks=10), async_scheduling=True)
        return h.engine.scheduler.num_preemptions

    assert run(go()) > 0


def test_abort_while_the_next_step_is_planned_gets_no_token_after_and_frees_once():
    async def go():
        group = PagedFake()
        group.gate = asyncio.Semaphore(0)
        async with Harness(group, async_scheduling=True) as h:
            group.after_step = lambda: h.engine.scheduler.check_invariants()
            h.engine.add(add_request("a", [4] * 20, 50), h.stream)
            h.engine.add(add_request("b", [9] * 20, 8), h.stream)
            for _ in range(3):
                group.gate.release()
            await h.wait(lambda: len(h.tokens("a")) >= 2 and len(group.sent) == 2)
            # Step N runs (gated), N+1 is queued behind it with a's placeholder: a is aborted now.
            seen, free_before = len(h.tokens("a")), h.engine.snapshot().kv_blocks_free
            h.engine.abort("a")
            # Its blocks stay held while the steps in flight write to them.
            assert h.engine.snapshot().kv_blocks_free == free_before
            for _ in range(40):
                group.gate.release()
            await h.wait(lambda: h.finished("b"))
            await h.wait(lambda: h.engine.snapshot().kv_blocks_free == h.engine.snapshot().kv_blocks_total)
            assert len(h.tokens("a")) == seen, "a token after the abort"
            assert not h.finished("a")  # an aborted request's router ended it already
            assert h.tokens("b") == expected([9] * 20, 8)
            assert 0 in group.forgotten  # the ranks were told to forget it
            h.engine.scheduler.check_invariants()  # and its blocks were freed once

    run(go())


def test_a_rank_lost_while_the_next_step_is_planned_loses_no_token():
    requests = {r: (p, 12, ()) for r, p in prompts(3).items()}

    def group():
        g = PagedFake()
        g.fail_steps = {5, 11}
        return g

    serial, overlap, _ = both(requests, group)
    for rid, (prompt, max_new, _) in requests.items():
        assert tokens_of(overlap[rid]) == tokens_of(serial[rid]) == expected(prompt, max_new)
        check_ends(overlap[rid])


def test_prefix_caching_and_async_scheduling():
    shared = [11, 12, 13] * 12
    requests = {f"p{i}": (shared + [20 + i] * (i + 1), 9, ()) for i in range(4)}
    serial, overlap, _ = both(requests, enable_prefix_caching=True)
    for rid, (prompt, max_new, _) in requests.items():
        assert tokens_of(overlap[rid]) == tokens_of(serial[rid]) == expected(prompt, max_new)


def test_steps_with_a_grammar_sequence_are_not_planned_ahead_of():
    async def go():
        group = PagedFake()
        async with Harness(group, async_scheduling=True) as h:
            msg = add_request("g", [4] * 20, 12)
            msg.sampling.structured_output.json_object = True
            h.engine.add(msg, h.stream)
            h.engine.add(add_request("plain", [9] * 30, 40), h.stream)
            await h.wait(lambda: h.finished("g") and h.finished("plain"))
            assert h.tokens("g") == expected([4] * 20, 12)
            assert h.tokens("plain") == expected([9] * 30, 40)
        return group

    group = run(go())
    assert group.grammars == {0} and group.behind_grammar == 0
    assert group.max_in_flight == 2  # once the grammar sequence ended, steps went ahead again


def test_choices_of_one_request_share_prompt_blocks_computed_by_a_step_in_flight():
    prompt = [3, 4, 5] * 20  # 60 tokens: 3 full blocks the other choices share (an unwritten slot: KeyError)

    async def go(async_scheduling):
        async with Harness(PagedFake(), async_scheduling=async_scheduling) as h:
            h.engine.add(add_request("c0", prompt, 10), h.stream)
            for k in (1, 2):
                msg = add_request(f"c{k}", prompt, 10)
                msg.fork_of = "c0"
                h.engine.add(msg, h.stream)
            await h.wait(lambda: all(h.finished(f"c{k}") for k in range(3)))
            await h.wait(lambda: h.engine.snapshot().kv_blocks_free == h.engine.snapshot().kv_blocks_total)
            return [h.tokens(f"c{k}") for k in range(3)]

    assert run(go(True)) == run(go(False)) == [expected(prompt, 10)] * 3


def test_async_scheduling_refuses_speculative_decoding():
    with pytest.raises(ValueError, match="async-scheduling"):
        SchedulerConfig(
            workers=("w:0",), async_scheduling=True, speculative=SpeculativePolicy(speculative_method="ngram")
        )


def test_a_sequence_ended_while_its_next_step_is_in_flight_gets_nothing_from_it():
    """The scheduler's side alone: plan and advance N, then N+1; N's token is a stop for s."""
    from scheduler.block_manager import BlockManager
    from scheduler.overlap import PLACEHOLDER, advance, apply
    from scheduler.scheduler import Scheduler
    from scheduler.sequence import Sequence

    blocks = BlockManager(8, BLOCK)
    sched = Scheduler(SchedulingPolicy(max_model_len=256), blocks, eos_token_ids=[1])
    s, t = Sequence(0, "s", [5] * 20, 20, 10), Sequence(1, "t", [6] * 20, 20, 10)
    sched.add(s), sched.add(t)
    n = sched.schedule()
    advance(n), blocks.step_sent(0, [0, 1])
    n1 = sched.schedule()  # planned while N is in flight: one placeholder each
    assert [i.num_new_tokens for i in n1.scheduled] == [1, 1]
    assert s.token_ids[-1] == PLACEHOLDER and s.num_computed_tokens == 20
    advance(n1), blocks.step_sent(1, [0, 1])
    updates = apply(sched, n, [[1], [7]])  # EOS for s
    blocks.step_returned(0)
    assert [(u.seq.request_id, u.new_tokens, u.finished) for u in updates] == [
        ("s", [1], True),
        ("t", [7], False),
    ]
    assert s.token_ids == [5] * 20 + [1] and s.is_finished  # its placeholder for N+1 is gone
    assert t.token_ids == [6] * 20 + [7, PLACEHOLDER]
    assert blocks.num_free_blocks == 8 - 4  # s's blocks wait for N+1, which writes to them
    updates = apply(sched, n1, [[9], [8]])
    blocks.step_returned(1)
    assert [(u.seq.request_id, u.new_tokens) for u in updates] == [("t", [8])]  # nothing for s
    assert blocks.num_free_blocks == 8 - 2
    sched.check_invariants()


def test_a_rank_puts_in_the_token_it_last_sampled_for_each_placeholder():
    from types import SimpleNamespace

    import torch

    from shard_worker.parallel import TensorParallel
    from shard_worker.worker import Worker, WorkerSequence

    worker = Worker(SimpleNamespace(tp=TensorParallel(), device=torch.device("cpu")))
    batch = [WorkerSequence(i, i, SimpleNamespace(output_ids=out)) for i, out in enumerate([[4, 8], [], [3]])]
    step = SimpleNamespace(query_lens=np.array([1, 3, 1]))
    step.input_ids = np.array([-1, 5, 6, 7, -1])  # a decode, a prompt, a decode
    assert worker._fill_placeholders(step, batch).tolist() == [8, 5, 6, 7, 3]
    step.input_ids = np.array([-1, 5, -1, 7, 2])  # a placeholder for a sequence that sampled nothing
    with pytest.raises(ValueError, match="sequence 1 has a placeholder"):
        worker._fill_placeholders(step, batch)


def test_a_sequence_its_token_in_flight_ends_by_length_is_not_planned_again():
    """Its blocks are then free as soon as that token comes back, as in the serial loop."""
    from scheduler.block_manager import BlockManager
    from scheduler.overlap import advance, apply
    from scheduler.scheduler import Scheduler
    from scheduler.sequence import Sequence

    blocks = BlockManager(8, BLOCK)
    sched = Scheduler(SchedulingPolicy(max_model_len=40), blocks)
    short, long = Sequence(0, "short", [5] * 20, 20, 1), Sequence(1, "long", [6] * 30, 30, 10)
    sched.add(short), sched.add(long)
    n = sched.schedule()
    advance(n), blocks.step_sent(0, [0, 1])
    n1 = sched.schedule()
    assert [i.seq.request_id for i in n1.scheduled] == ["long"]
    advance(n1), blocks.step_sent(1, [1])
    updates = apply(sched, n, [[7], [8]])
    blocks.step_returned(0)
    assert [(u.seq.request_id, u.finished) for u in updates] == [("short", True), ("long", False)]
    assert blocks.num_free_blocks == 8 - 2  # short's 2 blocks are back at once
    for step in range(2, 12):  # long runs into max_model_len 40: 10 tokens, never a step past it
        out = sched.schedule()
        advance(out), blocks.step_sent(step, [1])
        apply(sched, n1, [[9]])
        blocks.step_returned(step - 1)
        n1 = out
        if long.is_finished:
            break
    assert long.is_finished and long.num_tokens == 40 and not out.scheduled
    assert long.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    blocks.step_returned(step)
    assert blocks.num_free_blocks == 8
