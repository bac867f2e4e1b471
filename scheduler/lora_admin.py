"""The LoRA adapters a replica serves, loaded and unloaded while it serves (the router's
LoadLoRAAdapter / UnloadLoRAAdapter, on every replica).

The scheduler is the record: it refuses a request for any name not served, loads an adapter on every
rank at once (all of them, or none: a rank that refuses it has it unloaded from the others), and gives
the adapters loaded while serving again to ranks that come back after a loss (the start-up ones are in
their own --lora-modules). An unloaded adapter takes no new request at once; the ranks drop it once the
requests already accepted on it have ended. One operation at a time (a lock): a load never races the
unload of the same name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from common.pb.tpserve.v1 import generation_pb2
from scheduler.tasks import log_failure

log = logging.getLogger("tpserve.scheduler")

# How long an unloaded adapter still takes requests, for those the router accepted before the unload
# and sent just before it (the router sends them before it unloads, but on another call: order is not
# guaranteed between the two).
UNLOAD_GRACE_S = 1.0


class LoRAError(Exception):
    """An operation refused: the status the caller gets, and why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class LoRAAdmin:
    def __init__(self, enabled: bool, modules: tuple[str, ...], workers, in_use: Callable[[str], int]):
        """modules: --lora-modules (NAME=PATH); workers: the WorkerGroup; in_use(name): the requests
        accepted on an adapter that have not ended."""
        self.enabled = enabled
        self.served: dict[str, str] = dict(m.partition("=")[::2] for m in modules) if enabled else {}
        self.runtime: set[str] = set()  # loaded while serving: given again to ranks that come back
        # Unloaded, and requests on it still finishing: (its path, when it was unloaded).
        self.draining: dict[str, tuple[str, float]] = {}
        self._workers = workers
        self._in_use = in_use
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    def __contains__(self, name: str) -> bool:
        """Whether a request on this adapter is taken: served, or unloaded moments ago (a request the
        router accepted before the unload may still be on the wire: UNLOAD_GRACE_S)."""
        if name in self.served:
            return True
        unloaded = self.draining.get(name)  # after the grace, never: tidy may be dropping it from the ranks
        return unloaded is not None and time.monotonic() - unloaded[1] < UNLOAD_GRACE_S

    async def load(self, name: str, path: str, ready: bool) -> None:
        if not self.enabled:
            raise LoRAError(
                grpc.StatusCode.FAILED_PRECONDITION, "the server was started without --enable-lora"
            )
        if not name or not path:
            raise LoRAError(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are both required")
        async with self._lock:
            if name in self.served:
                raise LoRAError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"LoRA adapter {name!r} is already loaded (from {self.served[name]}); unload it first",
                )
            if name in self.draining:
                raise LoRAError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"LoRA adapter {name!r} is being unloaded: requests on it are still finishing; "
                    "load it again once they have",
                )
            if not ready:
                raise LoRAError(grpc.StatusCode.UNAVAILABLE, "the replica's shard workers are not ready")
            await self._load_on_ranks(name, path)
            self.served[name] = path
            self.runtime.add(name)
        log.info("LoRA adapter %r loaded from %s", name, path)

    async def _load_on_ranks(self, name: str, path: str) -> None:
        request = generation_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        answers = await self._workers.on_every_rank("LoadLoRAAdapter", request)
        errors = [(rank, a) for rank, a in enumerate(answers) if isinstance(a, BaseException)]
        if not answers or errors:
            if answers and len(errors) < len(answers):  # all or none: the others forget it
                await self._unload_on_ranks(name)
            if not answers:
                raise LoRAError(grpc.StatusCode.UNAVAILABLE, "the replica's shard workers are not ready")
            rank, e = errors[0]
            if isinstance(e, grpc.RpcError):
                code = e.code()
                if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    code = grpc.StatusCode.UNAVAILABLE
                raise LoRAError(code, e.details() if rank == 0 else f"rank {rank}: {e.details()}")
            raise LoRAError(grpc.StatusCode.INTERNAL, f"rank {rank}: {type(e).__name__}: {e}")

    async def unload(self, name: str) -> int:
        """Refuses new requests on the adapter (at the router; here, after UNLOAD_GRACE_S); returns how
        many accepted ones are still to finish. The ranks drop it once none is (tidy)."""
        async with self._lock:
            if name not in self.served:
                raise LoRAError(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded")
            self.draining[name] = (self.served.pop(name), time.monotonic())
            self.runtime.discard(name)
            finishing = self._in_use(name)
        log.info("LoRA adapter %r unloaded (%d request(s) on it finishing first)", name, finishing)
        return finishing

    def tidy(self) -> None:
        """Drops from the ranks each unloaded adapter no request runs on any more, UNLOAD_GRACE_S after
        its unload at the earliest. Called when requests end, and with every heartbeat."""
        now = time.monotonic()
        for name, (_, since) in list(self.draining.items()):
            if now - since < UNLOAD_GRACE_S or self._in_use(name):
                continue
            if not any(t.get_name() == name for t in self._tasks):
                task = asyncio.create_task(self._drop(name), name=name)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(log_failure)  # still draining: the next tidy tries again

    async def _drop(self, name: str) -> None:
        async with self._lock:
            await self._unload_on_ranks(name)
            self.draining.pop(name, None)
        log.info("LoRA adapter %r: its last request ended; the ranks dropped it", name)

    async def _unload_on_ranks(self, name: str) -> None:
        request = generation_pb2.UnloadLoRAAdapterRequest(lora_name=name)
        for rank, answer in enumerate(await self._workers.on_every_rank("UnloadLoRAAdapter", request)):
            if isinstance(answer, BaseException):  # a rank lost: it comes back without the adapter
                log.warning("LoRA adapter %r: rank %d did not unload it: %s", name, rank, answer)

    async def restore(self) -> list[str]:
        """Loads the adapters loaded while serving (and those unloaded whose requests still finish) on
        ranks that came back; returns those that no longer load (their requests must end)."""
        async with self._lock:
            return await self._restore()

    async def _restore(self) -> list[str]:
        lost = []
        wanted = {name: self.served[name] for name in sorted(self.runtime)}
        wanted |= {name: path for name, (path, _) in self.draining.items()}
        for name, path in wanted.items():
            try:
                await self._load_on_ranks(name, path)
            except LoRAError as e:
                log.error("LoRA adapter %r no longer loads on the ranks that came back: %s", name, e.message)
                if name in self.runtime:
                    del self.served[name]
                self.runtime.discard(name)
                self.draining.pop(name, None)
                lost.append(name)
        return lost
