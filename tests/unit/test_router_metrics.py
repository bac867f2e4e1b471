"""The router's scrape reads its queues and replicas on the event loop, never from the scrape thread."""

from __future__ import annotations

import asyncio
import threading

from router.buckets import AdmissionQueue
from router.metrics import RouterMetrics
from router.server import on_loop


class LoopOnlyQueue(AdmissionQueue):
    """An admission queue that refuses to be read from any thread but its loop's."""

    def __init__(self, loop_thread: int):
        super().__init__()
        self.loop_thread = loop_thread
        self.reads = 0

    def stats(self, now):
        assert threading.get_ident() == self.loop_thread, "the scrape read the queue off the loop"
        self.reads += 1
        return super().stats(now)


def test_scrape_reads_the_buckets_on_the_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        queue = LoopOnlyQueue(thread.ident)
        metrics = RouterMetrics(queue, on_loop=on_loop(loop))
        families = {f.name: f for f in metrics.registry.collect()}  # from this (the scrape's) thread
        assert queue.reads == 1
        assert "tpserve_router_queue_waiting_requests" in families
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
