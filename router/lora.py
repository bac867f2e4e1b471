"""The LoRA adapters the replicas serve, by name, as the router knows them: --lora-modules at start, and
those loaded and unloaded while serving (vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter,
tpserve.v1.Generation's LoadLoRAAdapter / UnloadLoRAAdapter), applied to every replica.

A load is all or nothing: it goes to every replica at once, and when one refuses it (or cannot be
reached) the replicas that took it unload it again and the call fails with that replica's status, so no
replica serves a name the router does not route. An unload takes the name out of the router first (new
requests get NOT_FOUND), sends the requests it accepted on the adapter that still wait in its queue, then
tells every replica, where the accepted ones finish before the ranks drop it; a replica
it cannot reach keeps the adapter but is never sent a request for it, and the call answers UNAVAILABLE
naming that replica. A replica that connects again (a restarted scheduler) is given the adapters loaded
while serving.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.pb.tpserve.v1 import generation_pb2 as pb

log = logging.getLogger("tpserve.router")

# A load reads the adapter on every rank of every replica: files of megabytes, not a step.
CALL_TIMEOUT_S = 120.0


class LoRANames:
    def __init__(self, config, pool, failed):
        """config: the RouterConfig (--enable-lora, --lora-modules); pool: the SchedulerPool, whose
        links reach every replica; failed: the RequestFailed class (router/request_failed.py)."""
        self.enabled = config.enable_lora
        self.paths: dict[str, str] = (
            dict(m.partition("=")[::2] for m in config.lora_modules) if self.enabled else {}
        )
        self.runtime: set[str] = set()  # loaded while serving: given again to a replica that reconnects
        self._pool = pool
        self._served_names = tuple(getattr(config, "served_model_name", ()))  # the base model's own names
        self._failed = failed
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def names(self) -> list[str]:
        """In the order they were loaded."""
        return list(self.paths)

    def path(self, name: str) -> str:
        return self.paths[name]

    async def load(self, name: str, path: str) -> None:
        """Loads the adapter on every replica, or on none (RequestFailed with the status of the first
        replica that refused it)."""
        fail = self._failed
        if not self.enabled:
            raise fail(grpc.StatusCode.FAILED_PRECONDITION, "the server was started without --enable-lora")
        for field, value in (("lora_name", name), ("lora_path", path)):
            if not value:
                raise fail(grpc.StatusCode.INVALID_ARGUMENT, f"{field} is required", field)
        info = self._pool.model_info
        if (info is not None and name == info.model_name) or name in self._served_names:
            raise fail(grpc.StatusCode.INVALID_ARGUMENT, f"{name!r} is the base model's name", "lora_name")
        async with self._lock:
            if name in self.paths:
                raise fail(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"LoRA adapter {name!r} is already loaded (from {self.paths[name]}); unload it first",
                    "lora_name",
                )
            links = list(self._pool.links.values())
            if not links:
                raise fail(grpc.StatusCode.UNAVAILABLE, "no replica to load the adapter on")
            request = pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
            answers = await _on_every(links, "LoadLoRAAdapter", request)
            failed = [
                (link, a) for link, a in zip(links, answers, strict=True) if isinstance(a, BaseException)
            ]
            if failed:
                took = [
                    link for link, a in zip(links, answers, strict=True) if not isinstance(a, BaseException)
                ]
                await _on_every(took, "UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(lora_name=name))
                link, e = failed[0]
                code, details = _status(e)
                where = f"replica {link.target}: " if len(links) > 1 else ""
                raise fail(
                    code, f"{where}{details}", "lora_path" if code == grpc.StatusCode.NOT_FOUND else None
                )
            self.paths[name] = path
            self.runtime.add(name)
        log.info("LoRA adapter %r loaded from %s on %d replica(s)", name, path, len(links))

    async def unload(self, name: str) -> int:
        """Stops routing requests to the adapter and unloads it from every replica; returns how many
        accepted requests on it are still finishing."""
        if name not in self.paths:
            raise self._failed(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded", "lora_name")
        async with self._lock:
            if self.paths.pop(name, None) is None:  # unloaded by the call that held the lock
                raise self._failed(
                    grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded", "lora_name"
                )
            self.runtime.discard(name)
            # Requests accepted before it are sent to their replica first (the replicas take requests on
            # an adapter for a moment after its unload: those on the wire).
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while self._pool.queued_on_adapter(name) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            links = list(self._pool.links.values())
            answers = await _on_every(links, "UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(lora_name=name))
        missed = [
            (link, a)
            for link, a in zip(links, answers, strict=True)
            if isinstance(a, BaseException) and _status(a)[0] != grpc.StatusCode.NOT_FOUND
        ]
        log.info(
            "LoRA adapter %r unloaded from %d of %d replica(s)", name, len(links) - len(missed), len(links)
        )
        if missed:
            link, e = missed[0]
            raise self._failed(
                grpc.StatusCode.UNAVAILABLE,
                f"LoRA adapter {name!r} is no longer routed, but replica {link.target} did not unload it: "
                f"{_status(e)[1]}",
            )
        return sum(a.requests_finishing for a in answers if not isinstance(a, BaseException))

    def reconnected(self, link) -> None:
        """A replica's stream (re)connected: it is given the adapters loaded while serving (a restarted
        scheduler has only its --lora-modules); one it still serves answers ALREADY_EXISTS."""
        if self.runtime:
            task = asyncio.create_task(self._restore(link))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _restore(self, link) -> None:
        for name in list(self.runtime):
            request = pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=self.paths[name])
            try:
                await link.stub.LoadLoRAAdapter(request, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                    log.error(
                        "replica %s: LoRA adapter %r not loaded again: %s", link.target, name, e.details()
                    )


async def _on_every(links, method: str, request) -> list:
    return await asyncio.gather(
        *(getattr(link.stub, method)(request, timeout=CALL_TIMEOUT_S) for link in links),
        return_exceptions=True,
    )


def _status(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, grpc.RpcError):
        code = e.code()
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            code = grpc.StatusCode.UNAVAILABLE
        return code, e.details() or code.name
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
