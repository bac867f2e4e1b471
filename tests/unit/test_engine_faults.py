"""The engine against ranks and routers that misbehave: a reply that does not fit its step, ranks that
come back unfit to serve, several routers sharing one admission window. Fake worker group, no processes."""

from __future__ import annotations

import asyncio

import pytest

from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_UNAVAILABLE
from scheduler.router_streams import RouterStream
from tests.unit.engine_harness import FakeWorkerGroup, Harness, add_request, expected, run


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
    import scheduler.ranks as ranks_module
    from scheduler.capacity import CapacityError

    monkeypatch.setattr(ranks_module, "UNFIT_RETRY_S", 0.05)

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


def test_an_idle_router_holding_old_credit_does_not_starve_a_new_one():
    """A router alone gets the whole window; when a second router connects and queues while the first
    stays idle, the second gets the window (the first's unused old credit is not kept for it). Before,
    the first's credit was reserved forever and a router added later never sent anything."""
    from router.buckets import Credits

    async def go():
        async with Harness(admission_window=4) as h:  # h.stream: the first router, idle, granted 4
            await h.wait(lambda: any(m.HasField("credit") and m.credit.window == 4 for m in h.messages))
            second, credits = RouterStream(), Credits()
            h.engine.attach(second)
            second.queued = 1
            h.engine.queued_changed()
            window = 0
            while not second.outbox.empty():
                msg = second.outbox.get_nowait()
                if msg.HasField("credit"):
                    credits.update(msg.credit.window, msg.credit.adds_received)
                    window = msg.credit.window
            assert window >= 1 and credits.take()
            h.engine.add(add_request("from-second", [3] * 4, 2), second)
            await h.wait(lambda: h.engine.snapshot().in_flight == 0)

    run(go())


def test_a_rank_lost_while_the_host_tier_holds_blocks_recovers():
    """The ranks' host memory goes with them: the engine's new pools start with an empty host tier (the
    router is told, by a snapshot), every request is recomputed to the tokens it would have had, and the
    new tier takes evicted prefixes and serves them again."""

    async def go():
        group = FakeWorkerGroup(num_blocks=12, num_host_blocks=16)
        tier = dict(enable_prefix_caching=True, swap_space=1.0, host_prefix_cache=True, block_size=4)
        async with Harness(group, **tier) as h:
            prefixes = [[3 + p] * 16 for p in range(3)]

            async def serve(name, n):
                prompts = {f"{name}{i}": prefixes[i % 3] + [50 + i] for i in range(n)}
                for rid, prompt in prompts.items():  # one after another: each evicts the one before
                    h.engine.add(add_request(rid, prompt, 6), h.stream)
                    await h.wait(lambda rid=rid: h.finished(rid))
                    assert h.tokens(rid) == expected(prompt, 6)

            await serve("a", 6)
            old = h.engine.scheduler.blocks
            assert old.host_tier.num_cached_blocks > 0 and old.host_tier.restored_blocks > 0
            resets = sum(m.kv_events.reset for m in h.messages)
            group.fail_steps = {group.steps + 3}
            await serve("b", 6)  # lost in its first request, which is recomputed
            new = h.engine.scheduler.blocks
            assert group.connects == 2 and new is not old and new.host_tier is not old.host_tier
            assert sum(m.kv_events.reset for m in h.messages) == resets + 1
            assert new.host_tier.offloaded_blocks > 0 and new.host_tier.restored_blocks > 0

    run(go())
