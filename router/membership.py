"""Which replicas exist: the --scheduler list, or the addresses a DNS name resolves to (a Kubernetes
headless Service), re-resolved every interval in a thread so replicas added or removed are picked up.

Membership only says who is there; the pool (router/pool.py) links to each one and routes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

log = logging.getLogger("tpserve.router")

# (host, port) -> the "HOST:PORT" addresses it resolves to now; raises OSError when it cannot tell.
Resolver = Callable[[str, int], list[str]]


def resolve_dns(host: str, port: int) -> list[str]:
    """Every address a name resolves to (a headless Service: one A/AAAA record per ready pod)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = set()
    for family, *_, sockaddr in infos:
        ip = sockaddr[0]
        out.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(out)


class Membership:
    """Calls add(target) for each replica that appears and remove(target) for each one that goes."""

    def __init__(
        self,
        add: Callable[[str], None],
        remove: Callable[[str], Awaitable[None]],
        *,
        schedulers: tuple[str, ...] = (),
        dns: str | None = None,  # NAME:PORT
        resolver: Resolver = resolve_dns,
        interval_s: float = 5.0,
    ):
        if not schedulers and not dns:
            raise ValueError("give at least one --scheduler or a --scheduler-dns")
        self._add, self._remove = add, remove
        self._static = tuple(schedulers)
        self.dns = dns
        self._resolver = resolver
        self._interval_s = interval_s
        self._current: set[str] = set()
        self._task: asyncio.Task | None = None

    @property
    def server_name(self) -> str | None:
        """The name replicas' certificates carry when they are dialled by a resolved IP."""
        return self.dns.rpartition(":")[0] if self.dns else None

    async def start(self) -> None:
        for target in self._static:
            self._current.add(target)
            self._add(target)
        if self.dns:
            await self.resolve_once()
            self._task = asyncio.create_task(self._resolve_forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def resolve_once(self) -> None:
        host, _, port = self.dns.rpartition(":")
        try:
            found = set(await asyncio.to_thread(self._resolver, host, int(port)))
        except OSError as e:  # a DNS blip must not drop every replica: keep the ones we have
            log.warning("resolving %s failed (%s): keeping %d replica(s)", self.dns, e, len(self._current))
            return
        for target in sorted(found - self._current):
            self._current.add(target)
            self._add(target)
        for target in sorted(self._current - found):
            self._current.discard(target)
            log.info("replica %s removed (gone from DNS)", target)
            await self._remove(target)

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.resolve_once()
