"""Replica discovery (router/membership.py) through the pool, with an injected resolver (no DNS server)."""

from __future__ import annotations

import asyncio

from router.buckets import AdmissionQueue
from router.membership import resolve_dns
from router.pool import SchedulerPool
from router.replicas import RoutingPolicy


def test_dns_discovery_adds_and_drops_replicas_and_keeps_them_through_a_failed_lookup():
    answers = {"now": ["10.0.0.1:50052", "10.0.0.2:50052"]}
    asked = []

    def resolver(host, port):
        asked.append((host, port))
        if answers["now"] is None:
            raise OSError("temporary failure in name resolution")
        return answers["now"]

    async def scenario():
        pool = SchedulerPool(
            AdmissionQueue(),
            RoutingPolicy(),
            on_ready=lambda ready: None,
            dns="tpserve-scheduler:50052",
            resolver=resolver,
            dns_interval_s=0.02,
            retry_s=10.0,
        )
        await pool.start()
        try:
            seen = [set(pool.links)]
            answers["now"] = ["10.0.0.2:50052", "10.0.0.3:50052"]  # one replica scaled in, one out
            await asyncio.sleep(0.2)
            seen.append(set(pool.links))
            answers["now"] = None  # DNS down: keep what we have
            await asyncio.sleep(0.2)
            seen.append(set(pool.links))
            return seen, pool.replicas.ids(), pool.ready
        finally:
            await pool.close()

    seen, ids, ready = asyncio.run(scenario())
    assert seen[0] == {"10.0.0.1:50052", "10.0.0.2:50052"}
    assert seen[1] == seen[2] == {"10.0.0.2:50052", "10.0.0.3:50052"}
    assert ids == sorted(seen[2])
    assert not ready  # none of them ever reported
    assert asked[0] == ("tpserve-scheduler", 50052) and len(asked) > 5


def test_resolve_dns_lists_every_address_once():
    addrs = resolve_dns("localhost", 50052)
    assert addrs and all(a.endswith(":50052") for a in addrs) and len(addrs) == len(set(addrs))
    assert "127.0.0.1:50052" in addrs or "[::1]:50052" in addrs
