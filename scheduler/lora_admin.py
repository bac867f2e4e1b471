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

from common.pb.tpserve.internal.v1 import worker_pb2
from common.pb.tpserve.v1 import generation_pb2
from scheduler.capacity import UnfitRanks
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


def check_lora_settings(enabled: bool, modules: tuple[str, ...], max_loras: int, ranks) -> None:
    """UnfitRanks, in one line, unless the ranks (their DescribeResponses) share one LoRA configuration
    and it is the scheduler's: it plans max_loras adapters a step (a rank with fewer slots would fail
    every step on them) and admits requests by the adapter names it serves (a rank without one would
    fail the step that brings it)."""

    def settings(r) -> tuple:
        names = sorted(m.partition("=")[0] for m in r.lora_modules)
        return (r.enable_lora, r.max_loras, r.max_lora_rank, r.max_cpu_loras, names)

    first = settings(ranks[0])
    for rank, r in enumerate(ranks[1:], start=1):
        if settings(r) != first:
            raise UnfitRanks(
                f"the ranks differ in their LoRA settings (--enable-lora, --max-loras, --max-lora-rank, "
                f"--max-cpu-loras, --lora-modules names): rank 0 {first}, rank {rank} {settings(r)}"
            )
    ours = sorted(m.partition("=")[0] for m in modules) if enabled else []
    theirs = (first[0], first[1] if first[0] else max_loras, first[4])
    if (enabled, max_loras, ours) != theirs:
        raise UnfitRanks(
            "the scheduler and the shard workers differ in their LoRA settings: here --enable-lora "
            f"{enabled}, --max-loras {max_loras}, --lora-modules {ours}; on the workers {theirs[0]}, "
            f"{first[1]}, {theirs[2]} (give both the same flags; tpserve launch does)"
        )


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
        self._prefetching: dict[str, asyncio.Task] = {}

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

    def prefetch(self, name: str, done: Callable[[str, str | None], None]) -> None:
        """Has every rank read adapter `name` into its host cache if it is not there (off the step path),
        unless that is under way; then done(name, error): error is a rank's NOT_FOUND naming why its files
        do not read, None otherwise (read, already there, or a rank that did not answer: then a step
        reads it, or the rank is lost and the group rebuilt)."""
        if name in self._prefetching:
            return
        task = asyncio.create_task(self._prefetch(name, done), name=f"prefetch of LoRA adapter {name!r}")
        self._prefetching[name] = task
        task.add_done_callback(lambda t: self._forget_prefetch(name, t))  # cancelled before it ran
        task.add_done_callback(log_failure)

    def _forget_prefetch(self, name: str, task: asyncio.Task) -> None:
        if self._prefetching.get(name) is task:
            del self._prefetching[name]

    async def _prefetch(self, name: str, done: Callable[[str, str | None], None]) -> None:
        error = None
        try:
            request = worker_pb2.PrefetchLoRAAdapterRequest(lora_name=name)
            for answer in await self._workers.on_every_rank("PrefetchLoRAAdapter", request):
                if isinstance(answer, grpc.RpcError) and answer.code() == grpc.StatusCode.NOT_FOUND:
                    error = answer.details()
        finally:  # whatever happens, the requests held for it are let go (or failed)
            # Forgotten before done, not in a done callback: a request on it added between the two
            # (its add runs before the task's callbacks) would find this prefetch still listed, start
            # none, and wait for an answer that has already been given.
            self._forget_prefetch(name, asyncio.current_task())
            done(name, error)

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
