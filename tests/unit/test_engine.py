"""The scheduler's Engine on its own, driven by a fake worker group: requests in through a router stream,
tokens out, ranks lost mid-step and back, ranks that never come back, a rank lost while idle, credit and
load reports, and an abort while a step is in flight. No processes, no gRPC, no torch."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common.pb.tpserve.internal.v1 import scheduler_pb2, worker_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_UNAVAILABLE
from common.pb.tpserve.v1 import generation_pb2
from scheduler.capacity import Capacity
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.router_streams import RouterStream
from scheduler.workers import WorkerGroupInfo, WorkersLost

VOCAB = 100
EOS = 1


def next_token(tokens: list[int]) -> int:
    """The fake model: the next token depends only on the tokens so far (never EOS)."""
    return 2 + (sum(tokens) * 31 + len(tokens)) % (VOCAB - 2)


def expected(prompt: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


class FakeWorkerGroup:
    """Stands in for scheduler/workers.py's WorkerGroup: one rank that answers steps with next_token."""

    def __init__(self, num_blocks: int = 64):
        self.num_blocks = num_blocks
        self.up = True  # connect() succeeds
        self.fail_steps: set[int] = set()  # steps (counted over the group's life) that lose the rank
        self.gate: asyncio.Semaphore | None = None  # when set up, each step waits for a release
        # step number -> a function that mangles that step's reply (a rank answering nonsense)
        self.mangle: dict = {}
        self.connect_errors: list[Exception] = []  # raised by the next connects, one each
        self.steps = 0
        self.connects = 0
        self.forgotten: list[int] = []
        self._tokens: dict[int, list[int]] = {}
        self._broken: str | None = None
        self._on_lost = None

    async def connect(self, on_lost=lambda: None) -> WorkerGroupInfo:
        if not self.up:
            raise WorkersLost("connection refused")
        if self.connect_errors:
            raise self.connect_errors.pop(0)
        self.connects += 1
        self._tokens.clear()
        self._broken, self._on_lost = None, on_lost
        describe = worker_pb2.DescribeResponse(
            rank=0, world_size=1, model_name="fake", vocab_size=VOCAB, max_position_embeddings=512,
            eos_token_ids=[EOS], num_kv_blocks=self.num_blocks,
        )  # fmt: skip
        return WorkerGroupInfo((describe,), Capacity(self.num_blocks, 512, 0))

    def lose_while_idle(self) -> None:
        """The rank's stream ends on its own (the process was killed) while nothing is stepping."""
        self._broken = "rank 0's step stream ended"
        self._on_lost()

    def check(self) -> None:
        if self._broken:
            raise WorkersLost(self._broken)

    async def step(self, data: bytes, step_id: int) -> list[worker_pb2.StepResponse]:
        self.steps += 1
        req = worker_pb2.StepRequest.FromString(data)
        for init in req.new_sequences:
            self._tokens[init.seq_id] = list(init.token_ids)
        self.forgotten += list(req.forgotten_seq_ids)
        if self.gate is not None:
            await self.gate.acquire()
        if self.steps in self.fail_steps:
            raise WorkersLost("rank 0 died mid-step")
        seq_ids = np.frombuffer(req.seq_ids, "<i8")
        counts = np.frombuffer(req.sample_counts, "<i8")
        tokens = []
        for seq_id, n in zip(seq_ids.tolist(), counts.tolist(), strict=True):
            if n:
                t = next_token(self._tokens[seq_id])
                self._tokens[seq_id].append(t)
                tokens.append(t)
        reply = worker_pb2.StepResponse(step_id=step_id, token_ids=tokens, token_counts=[1] * len(tokens))
        if self.steps in self.mangle:
            self.mangle[self.steps](reply)
        return [reply]

    async def close(self) -> None:
        pass


def add_request(request_id: str, prompt: list[int], max_new: int) -> scheduler_pb2.AddRequest:
    greedy = generation_pb2.SamplingParams(temperature=0.0)
    return scheduler_pb2.AddRequest(
        request_id=request_id, prompt_token_ids=prompt, max_new_tokens=max_new, sampling=greedy
    )


class Harness:
    """An engine, its fake group and one router stream, with what the router received."""

    def __init__(self, group: FakeWorkerGroup | None = None, **config):
        config.setdefault("worker_recovery_timeout_s", 30.0)
        self.group = group or FakeWorkerGroup()
        self.engine = Engine(SchedulerConfig(workers=("fake:0",), **config), self.group)
        self.stream = RouterStream()
        self.messages: list[scheduler_pb2.SchedulerMessage] = []
        self.ready_changes: list[bool] = []
        self.engine.watch_status(self.ready_changes.append)

    async def __aenter__(self):
        self.task = asyncio.create_task(self.engine.serve_forever())
        self.pump = asyncio.create_task(self._pump())
        await self.wait(lambda: self.engine.ready.is_set())
        self.engine.attach(self.stream)
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        self.pump.cancel()
        await asyncio.gather(self.task, self.pump, return_exceptions=True)

    async def _pump(self):
        while True:
            self.messages.append(await self.stream.outbox.get())

    async def wait(self, condition, timeout: float = 20.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.005)

    def outputs(self, request_id: str) -> list[scheduler_pb2.RequestOutput]:
        return [o for m in self.messages for o in m.outputs if o.request_id == request_id]

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs(request_id) for t in o.token_ids]

    def finished(self, request_id: str) -> bool:
        return any(o.finish_reason or o.error for o in self.outputs(request_id))


def run(coro):
    return asyncio.run(coro)


def test_requests_complete_with_the_model_tokens_and_free_their_blocks():
    async def go():
        async with Harness() as h:
            prompts = {f"r{i}": [3 + i] * (5 + 7 * i) for i in range(4)}
            for rid, prompt in prompts.items():
                h.engine.add(add_request(rid, prompt, 6), h.stream)
            await h.wait(lambda: all(h.finished(r) for r in prompts))
            for rid, prompt in prompts.items():
                assert h.tokens(rid) == expected(prompt, 6)
                assert h.outputs(rid)[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
            snap = h.engine.snapshot()
            assert snap.kv_blocks_free == snap.kv_blocks_total and snap.in_flight == 0
            assert not h.engine.routers.request_ids  # every request's credit came back

    run(go())


def test_credit_and_load_reports():
    async def go():
        async with Harness(admission_window=4) as h:
            await h.wait(lambda: any(m.HasField("credit") for m in h.messages))
            first = next(m.credit for m in h.messages if m.HasField("credit"))
            assert first.window == 4 and first.adds_received == 0
            assert any(m.HasField("load") and m.load.shards_ready for m in h.messages)
            h.engine.add(add_request("r0", [5] * 8, 30), h.stream)
            await h.wait(lambda: any(m.HasField("load") and m.load.running == 1 for m in h.messages))
            load = next(m.load for m in h.messages if m.HasField("load") and m.load.running == 1)
            assert load.adds_received == 1 and load.max_num_seqs == 128
            assert 0 < load.kv_blocks_free < load.kv_blocks_total
            await h.wait(lambda: h.finished("r0"))

    run(go())


def test_a_rank_lost_mid_step_and_back_loses_no_token():
    async def go():
        group = FakeWorkerGroup()
        group.fail_steps = {4, 9}
        async with Harness(group) as h:
            prompts = {f"r{i}": [7 + i] * (3 + 5 * i) for i in range(3)}
            for rid, prompt in prompts.items():
                h.engine.add(add_request(rid, prompt, 10), h.stream)
            await h.wait(lambda: all(h.finished(r) for r in prompts))
            for rid, prompt in prompts.items():
                assert h.tokens(rid) == expected(prompt, 10)  # recomputed, each token once
            assert group.connects == 3
            assert h.ready_changes == [False, True, False, True, False, True]

    run(go())


def test_requests_of_a_rank_that_never_returns_expire_each_on_its_own_clock():
    """Expiry fails what waited worker_recovery_timeout_s since the loss, and also a request accepted
    after that, while the ranks stay down (it used to wait forever)."""

    async def go():
        group = FakeWorkerGroup()
        group.fail_steps = {2}
        async with Harness(group, worker_recovery_timeout_s=0.3) as h:
            h.engine.add(add_request("before", [4] * 6, 20), h.stream)
            group.up = False  # the rank dies at step 2 and stays down
            await h.wait(lambda: h.finished("before"))
            [out] = [o for o in h.outputs("before") if o.error]
            assert out.error_code == ERROR_CODE_UNAVAILABLE
            h.engine.add(add_request("after", [4] * 6, 20), h.stream)
            await h.wait(lambda: h.finished("after"))
            [out] = [o for o in h.outputs("after") if o.error]
            assert out.error_code == ERROR_CODE_UNAVAILABLE
            assert not h.engine.routers.request_ids
            # The ranks come back: a new request is served.
            group.up = True
            await h.wait(lambda: h.engine.ready.is_set())
            h.engine.add(add_request("later", [4] * 6, 3), h.stream)
            await h.wait(lambda: h.finished("later"))
            assert h.tokens("later") == expected([4] * 6, 3)

    run(go())


def test_a_rank_lost_while_idle_turns_the_replica_not_ready_at_once():
    async def go():
        group = FakeWorkerGroup()
        async with Harness(group) as h:
            h.engine.add(add_request("r0", [5] * 4, 2), h.stream)
            await h.wait(lambda: h.finished("r0"))
            group.up = False
            group.lose_while_idle()  # nothing is stepping: only the stream's end tells
            await h.wait(lambda: not h.engine.ready.is_set())
            group.up = True
            await h.wait(lambda: h.engine.ready.is_set())
            assert h.ready_changes[-2:] == [False, True] and group.connects == 2

    run(go())


def test_abort_while_a_step_is_in_flight_drops_its_tokens_and_frees_its_blocks():
    async def go():
        group = FakeWorkerGroup()
        async with Harness(group) as h:
            group.gate = asyncio.Semaphore(0)
            h.engine.add(add_request("r0", [5] * 20, 50), h.stream)
            h.engine.add(add_request("r1", [6] * 20, 5), h.stream)
            for _ in range(3):
                group.gate.release()
            await h.wait(lambda: len(h.tokens("r0")) == 3 and group.steps == 4)  # step 4 waits on the rank
            h.engine.abort("r0")
            seen = len(h.tokens("r0"))
            gate, group.gate = group.gate, None  # later steps do not wait
            gate.release()  # step 4 answers, with a token for r0
            await h.wait(lambda: h.finished("r1"))
            assert len(h.tokens("r0")) == seen  # nothing after the abort
            assert not h.finished("r0")  # the router asked for it: no final output
            snap = h.engine.snapshot()
            assert snap.kv_blocks_free == snap.kv_blocks_total
            # The rank is told to forget it with the next step that goes out.
            h.engine.add(add_request("r2", [7] * 3, 1), h.stream)
            await h.wait(lambda: h.finished("r2"))
            assert 0 in group.forgotten

    run(go())


@pytest.mark.parametrize("bad", ["add", "abort"])
def test_a_failing_message_does_not_stop_the_connect_reader(bad):
    """An unexpected exception handling one router message fails that request (INTERNAL) and the
    stream goes on reading: later adds are served (before, the reader task died silently while
    heartbeats still flowed)."""
    from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_INTERNAL
    from scheduler.server import SchedulerServicer

    async def go():
        async with Harness() as h:
            real_add, real_abort = h.engine.add, h.engine.abort

            def add(msg, stream):
                if msg.request_id == "boom":
                    raise RuntimeError("a bug")
                real_add(msg, stream)

            def abort(request_id):
                if request_id == "boom":
                    raise RuntimeError("a bug")
                real_abort(request_id)

            h.engine.add, h.engine.abort = add, abort
            incoming: asyncio.Queue = asyncio.Queue()

            async def messages():
                while True:
                    yield await incoming.get()

            call = SchedulerServicer(h.engine).Connect(messages(), None)
            got: list = []

            async def read():
                async for m in call:
                    got.append(m)

            reader = asyncio.create_task(read())
            if bad == "add":
                incoming.put_nowait(scheduler_pb2.RouterMessage(add=add_request("boom", [3] * 4, 2)))
            else:
                abort_msg = scheduler_pb2.AbortRequest(request_id="boom")
                incoming.put_nowait(scheduler_pb2.RouterMessage(abort=abort_msg))
            incoming.put_nowait(scheduler_pb2.RouterMessage(add=add_request("ok", [3] * 4, 2)))

            def outputs(rid):
                return [o for m in got for o in m.outputs if o.request_id == rid]

            await h.wait(lambda: any(o.finish_reason for o in outputs("ok")))
            if bad == "add":
                [err] = outputs("boom")
                assert err.error_code == ERROR_CODE_INTERNAL and "a bug" in err.error
            reader.cancel()

    run(go())


def _empty_first_group(reply):
    """Rank 0 gives the first sequence no token and the second two: the totals still add up."""
    reply.token_counts[:] = [0, 2] + list(reply.token_counts[2:])


def _second_group_too_many(reply):
    """The first sequence's token is fine; the second gets two for its one sampled position."""
    reply.token_counts[:] = [1, 2, 0] + list(reply.token_counts[3:])


@pytest.mark.parametrize("mangle", [_empty_first_group, _second_group_too_many])
def test_a_reply_that_does_not_fit_the_step_is_a_lost_rank_and_changes_nothing(mangle):
    """Before, Scheduler.update raised midway (earlier sequences already updated) and the step loop died
    with every request in flight."""

    async def go():
        group = FakeWorkerGroup()
        async with Harness(group) as h:
            group.gate = asyncio.Semaphore(0)
            prompts = {f"r{i}": [9 + i] * (4 + i) for i in range(3)}
            for rid, prompt in prompts.items():
                h.engine.add(add_request(rid, prompt, 8), h.stream)
            group.mangle = {group.steps + 3: mangle}  # a decode step of all three
            gate, group.gate = group.gate, None
            for _ in range(100):
                gate.release()
            await h.wait(lambda: all(h.finished(r) for r in prompts))
            for rid, prompt in prompts.items():
                assert h.tokens(rid) == expected(prompt, 8)  # each token once, in order
            assert group.connects == 2
            snap = h.engine.snapshot()
            assert snap.kv_blocks_free == snap.kv_blocks_total

    run(go())


def test_ranks_back_unfit_to_serve_fail_the_requests_in_flight_and_the_engine_goes_on(monkeypatch):
    """A CapacityError when the ranks return used to end the scheduler with requests in flight; they
    now end with UNAVAILABLE naming it (the router resends them elsewhere) and the engine retries."""
    import scheduler.engine as engine_module
    from scheduler.capacity import CapacityError

    monkeypatch.setattr(engine_module, "UNFIT_RETRY_S", 0.05, raising=False)

    async def go():
        group = FakeWorkerGroup()
        async with Harness(group) as h:
            group.gate = asyncio.Semaphore(0)
            h.engine.add(add_request("r0", [5] * 6, 50), h.stream)
            await h.wait(lambda: group.steps == 1)
            group.fail_steps = {group.steps + 1}
            group.connect_errors = [CapacityError("rank 1 has 10% less memory than rank 0")]
            gate, group.gate = group.gate, None
            for _ in range(5):
                gate.release()
            await h.wait(lambda: h.finished("r0"))
            [out] = [o for o in h.outputs("r0") if o.error]
            assert out.error_code == ERROR_CODE_UNAVAILABLE and "10% less memory" in out.error
            await h.wait(lambda: h.engine.ready.is_set())
            h.engine.add(add_request("r1", [5] * 6, 3), h.stream)
            await h.wait(lambda: h.finished("r1"))
            assert h.tokens("r1") == expected([5] * 6, 3)
            assert not h.task.done()

    run(go())


def test_several_routers_together_never_send_more_than_the_admission_window():
    """The window is split among the routers' streams (each spends its share less its adds on the
    wire). Before, every stream got the whole window, so two routers with full queues sent twice it."""
    from router.buckets import Credits

    async def go():
        group = FakeWorkerGroup()
        async with Harness(group, admission_window=4) as h:
            group.gate = asyncio.Semaphore(0)  # the first step blocks: what is added after waits
            h.engine.add(add_request("first", [3] * 4, 2), h.stream)
            await h.wait(lambda: group.steps == 1)
            h.engine.detach(h.stream)  # its request aborted: the window is 4 again, and two routers come
            routers = []
            for r in range(2):
                stream, credits = RouterStream(), Credits()
                routers.append(
                    (stream, credits, [add_request(f"{r}-{i}", [4 + r] * 5, 2) for i in range(10)])
                )
                h.engine.attach(stream)
            for stream, credits, _ in routers:  # connected and settled, with nothing queued yet
                while not stream.outbox.empty():
                    msg = stream.outbox.get_nowait()
                    if msg.HasField("credit"):
                        credits.update(msg.credit.window, msg.credit.adds_received)
            for stream, _, queue in routers:  # then both fill up
                stream.queued = len(queue)
                h.engine.queued_changed()

            async def router(stream, credits, queue):
                while True:
                    while queue and credits.take():
                        h.engine.add(queue.pop(0), stream)
                        stream.queued = len(queue)
                        h.engine.queued_changed()
                    msg = await stream.outbox.get()
                    if msg.HasField("credit"):
                        credits.update(msg.credit.window, msg.credit.adds_received)

            tasks = [asyncio.create_task(router(*r)) for r in routers]
            await asyncio.sleep(0.3)  # every credit message is read and spent by now
            waiting = h.engine.snapshot().waiting
            sent = sum(10 - len(q) for _, _, q in routers)
            assert sent == waiting == 4, (sent, waiting)
            for t in tasks:
                t.cancel()
            gate, group.gate = group.gate, None
            gate.release()

    run(go())
