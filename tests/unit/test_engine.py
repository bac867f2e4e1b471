"""The scheduler's Engine on its own, driven by a fake worker group: requests in through a router stream,
tokens out, ranks lost mid-step and back, ranks that never come back, a rank lost while idle, credit and
load reports, and an abort while a step is in flight. No processes, no gRPC, no torch."""

from __future__ import annotations

import asyncio

import pytest

from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_UNAVAILABLE
from common.pb.tpserve.v1 import generation_pb2
from tests.unit.engine_harness import FakeWorkerGroup, Harness, add_request, expected, run


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
