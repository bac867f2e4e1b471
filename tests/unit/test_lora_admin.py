"""The scheduler's side of LoRA adapters loaded and unloaded while serving (scheduler/lora_admin.py),
over a fake rank: a load reaches every rank or none, an unload refuses new requests and lets the accepted
ones finish before the ranks drop it, and ranks that come back are given the runtime adapters again."""

from __future__ import annotations

import asyncio

import grpc
import pytest

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
