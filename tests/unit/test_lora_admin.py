"""LoRA adapters loaded and unloaded while serving, over fakes. The scheduler's side (scheduler/
lora_admin.py): a load reaches every rank or none, an unload refuses new requests and lets the accepted
ones finish before the ranks drop it, and ranks that come back are given the runtime adapters again. The
router's (router/lora.py): the same all-or-nothing load over replicas, and an unload from every one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.frontend import RequestFailed
from router.lora import LoRANames
from scheduler import lora_admin
from scheduler.lora_admin import LoRAError
from tests.unit.engine_harness import FakeWorkerGroup, Harness, add_request, expected, run


class RankError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class LoRAGroup(FakeWorkerGroup):
    """Two ranks' LoRA calls, recorded; rank 1 refuses any path in `refused`."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.refused: set[str] = set()

    async def on_every_rank(self, method: str, request) -> list:
        self.calls.append((method, request.lora_name))
        if method == "LoadLoRAAdapter" and request.lora_path in self.refused:
            return [object(), RankError(grpc.StatusCode.INVALID_ARGUMENT, "rank 64 is above 16")]
        return [object(), object()]


def _on(name: str, rid: str, max_new: int = 6):
    add = add_request(rid, [3, 4, 5], max_new)
    add.lora_name = name
    return add


def test_load_on_every_rank_or_none_unload_after_the_accepted_requests(monkeypatch):
    monkeypatch.setattr(lora_admin, "UNLOAD_GRACE_S", 0.0)  # the router's queue is not in this test
    group = LoRAGroup()

    async def go():
        async with Harness(group, enable_lora=True, lora_modules=("a=/a",)) as h:
            admin = h.engine.loras
            group.refused.add("/big")
            with pytest.raises(LoRAError) as e:
                await admin.load("b", "/big", ready=True)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("rank 1:")
            # Rank 0 had taken it: it is unloaded there again, and the name is not served.
            assert group.calls == [("LoadLoRAAdapter", "b"), ("UnloadLoRAAdapter", "b")]
            assert "b" not in admin
            with pytest.raises(LoRAError) as e:
                await admin.load("a", "/a2", ready=True)
            assert e.value.code == grpc.StatusCode.ALREADY_EXISTS

            await admin.load("b", "/b", ready=True)
            group.gate = asyncio.Semaphore(0)  # steps wait: the request stays in flight
            h.engine.add(_on("b", "r1"), h.stream)
            await h.wait(lambda: group.steps >= 1)
            assert await admin.unload("b") == 1
            h.engine.add(_on("b", "r2"), h.stream)  # new ones are refused
            await h.wait(lambda: h.outputs("r2"))
            assert h.outputs("r2")[-1].error_code == grpc.StatusCode.NOT_FOUND.value[0]
            with pytest.raises(LoRAError) as e:
                await admin.load("b", "/b", ready=True)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION  # still finishing
            admin.tidy()  # as a heartbeat does: the ranks keep it while r1 runs
            await asyncio.sleep(0.05)
            assert ("UnloadLoRAAdapter", "b") not in group.calls[2:]
            for _ in range(20):
                group.gate.release()
            await h.wait(lambda: h.finished("r1"))
            assert h.tokens("r1") == expected([3, 4, 5], 6)  # the accepted one finished
            await h.wait(lambda: ("UnloadLoRAAdapter", "b") in group.calls[2:] and not admin.draining)
            with pytest.raises(LoRAError) as e:
                await admin.unload("b")
            assert e.value.code == grpc.StatusCode.NOT_FOUND

            # Ranks that come back are given the adapters loaded while serving (not the start-up ones).
            await admin.load("c", "/c", ready=True)
            group.gate = None
            group.calls.clear()
            group.lose_while_idle()
            await h.wait(lambda: group.connects == 2 and h.engine.ready.is_set())
            assert group.calls == [("LoadLoRAAdapter", "c")]
            h.engine.add(_on("c", "r3"), h.stream)
            await h.wait(lambda: h.finished("r3"))
            assert h.tokens("r3") == expected([3, 4, 5], 6)

    run(go())


class SchedulerStub:
    """A replica's scheduler as the router's LoRANames calls it; `refuse`: (code, details) to raise."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.refuse: tuple | None = None

    async def LoadLoRAAdapter(self, request, timeout):
        return self._answer("load", request, pb.LoadLoRAAdapterResponse())

    async def UnloadLoRAAdapter(self, request, timeout):
        return self._answer("unload", request, pb.UnloadLoRAAdapterResponse(requests_finishing=2))

    def _answer(self, what, request, answer):
        self.calls.append((what, request.lora_name))
        if self.refuse:
            raise RankError(*self.refuse)
        return answer


def test_the_router_loads_on_every_replica_or_none_and_unloads_from_every_one():
    stubs = {"r1": SchedulerStub(), "r2": SchedulerStub()}
    links = {t: SimpleNamespace(target=t, stub=s) for t, s in stubs.items()}
    pool = SimpleNamespace(links=links, model_info=None, queued_on_adapter=lambda name: 0)
    names = LoRANames(SimpleNamespace(enable_lora=True, lora_modules=("a=/a",)), pool, RequestFailed)

    async def go():
        stubs["r2"].refuse = (grpc.StatusCode.INVALID_ARGUMENT, "rank 64 is above --max-lora-rank 16")
        with pytest.raises(RequestFailed) as e:
            await names.load("b", "/b")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.message == "replica r2: rank 64 is above --max-lora-rank 16"
        assert stubs["r1"].calls == [("load", "b"), ("unload", "b")]  # r1 had taken it: no longer
        assert "b" not in names and names.names() == ["a"]
        stubs["r2"].refuse = None
        await names.load("b", "/b")
        assert names.names() == ["a", "b"] and names.path("b") == "/b"
        with pytest.raises(RequestFailed) as e:
            await names.load("b", "/b")
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert await names.unload("b") == 4  # requests finishing on both replicas
        # A replica that cannot be reached: the name is no longer routed, and the call says so.
        await names.load("c", "/c")
        stubs["r1"].refuse = (grpc.StatusCode.UNAVAILABLE, "connection refused")
        with pytest.raises(RequestFailed) as e:
            await names.unload("c")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "replica r1 did not unload it" in e.value.message
        assert "c" not in names
        with pytest.raises(RequestFailed) as e:
            await names.unload("c")
        assert e.value.code == grpc.StatusCode.NOT_FOUND

    run(go())


def test_a_request_added_as_a_prefetch_answers_is_not_left_waiting():
    """A request on an adapter that arrives after a prefetch of it has answered, but before the task's
    own callbacks run, starts a prefetch of its own and hears its answer: CI once saw such a request
    wait for ever (a DEADLINE_EXCEEDED in test_lora_serving's second round)."""
    group = LoRAGroup()
    answers: list[str] = []

    async def go():
        loop = asyncio.get_running_loop()
        admin = lora_admin.LoRAAdmin(True, ("a=/a",), group, lambda name: 0)
        second = loop.create_future()

        def first_done(name, error):
            answers.append(f"first {error}")
            # The next add on the event loop runs before the finished task's done callbacks.
            loop.call_soon(admin.prefetch, name, lambda n, e: second.set_result(f"second {e}"))

        admin.prefetch("a", first_done)
        answers.append(await asyncio.wait_for(second, 5))

    asyncio.run(go())
    assert answers == ["first None", "second None"]
    assert group.calls == [("PrefetchLoRAAdapter", "a")] * 2
