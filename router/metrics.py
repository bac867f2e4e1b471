"""The router's Prometheus metrics: what a client sees of each request."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS


def _direct(fn):
    return fn()


class _BucketCollector:
    """Waiting requests and the oldest wait per length bucket, read at scrape time on the event loop (the
    queues are the loop's: read from the scrape thread, a bucket emptied mid-read breaks the scrape)."""

    def __init__(self, admission, on_loop):
        self.admission = admission
        self.on_loop = on_loop

    def collect(self):
        stats = self.on_loop(lambda: self.admission.stats(time.monotonic()))
        waiting = GaugeMetricFamily(
            "tpserve_router_queue_waiting_requests", "Requests waiting per length bucket.", labels=["bucket"]
        )
        oldest = GaugeMetricFamily(
            "tpserve_router_queue_oldest_wait_seconds", "Oldest wait per length bucket.", labels=["bucket"]
        )
        for b in stats:
            waiting.add_metric([b.name], b.waiting)
            oldest.add_metric([b.name], b.oldest_wait_s)
        yield waiting
        yield oldest


class _ReplicaCollector:
    """Each replica's state as the router sees it (label replica = its scheduler's address), read at
    scrape time from the last load reports."""

    GAUGES = (
        ("up", "1 when the router sends new requests to the replica, else 0."),
        ("headroom", "The routing score for long prompts: 1 idle, below 0 work queues there."),
        ("running", "Sequences running in the replica's batch (its last report)."),
        ("waiting", "Sequences waiting in the replica's scheduler (its last report)."),
        ("kv_blocks_free", "The replica's free KV blocks (its last report)."),
        ("kv_blocks_total", "The replica's KV blocks (its last report)."),
        ("pending", "Requests sent to the replica that its last report does not count yet."),
        ("report_age_seconds", "Seconds since the replica's last load report."),
        ("cached_blocks", "KV block hashes the router's index holds for the replica (its KV events)."),
    )
    COUNTERS = (
        ("routed", "Requests sent to the replica (failover resends included)."),
        ("cache_hit_tokens", "Prompt tokens the replica's prefix cache held when routed there."),
        ("cache_index_dropped", "Block hashes of the replica the router's index forgot for lack of room."),
    )

    def __init__(self, on_loop):
        self.pool = None
        self.on_loop = on_loop

    def collect(self):
        families = {
            name: GaugeMetricFamily(f"tpserve_router_replica_{name}", doc, labels=["replica"])
            for name, doc in self.GAUGES
        }
        counters = {
            name: CounterMetricFamily(f"tpserve_router_replica_{name}", doc, labels=["replica"])
            for name, doc in self.COUNTERS
        }
        pool = self.pool
        stats = self.on_loop(lambda: pool.replicas.stats(time.monotonic())) if pool is not None else []
        for r in stats:
            load = r.load
            values = {
                "up": float(r.up),
                "headroom": r.headroom if r.up else 0.0,
                "running": load.running if load else 0,
                "waiting": load.waiting if load else 0,
                "kv_blocks_free": load.kv_blocks_free if load else 0,
                "kv_blocks_total": load.kv_blocks_total if load else 0,
                "pending": r.pending,
                "report_age_seconds": r.report_age_s if load else -1.0,
                "cached_blocks": r.cached_blocks,
            }
            for name, value in values.items():
                families[name].add_metric([r.replica], value)
            counters["routed"].add_metric([r.replica], r.routed_total)
            counters["cache_hit_tokens"].add_metric([r.replica], r.cache_hit_tokens_total)
            counters["cache_index_dropped"].add_metric([r.replica], r.index_dropped_total)
        yield from families.values()
        yield from counters.values()


class RouterMetrics:
    def __init__(self, admission=None, on_loop=_direct):
        """on_loop(fn): runs fn where the router's state lives (its event loop) and returns the result;
        the scrape thread reads queues and replicas only through it. Direct by default (tests)."""
        r = self.registry = CollectorRegistry()
        if admission is not None:
            r.register(_BucketCollector(admission, on_loop))
        self._replicas = _ReplicaCollector(on_loop)
        r.register(self._replicas)
        self.failovers = Counter(
            "tpserve_router_failover_requests",
            "Requests on a replica that was lost: resent (nothing streamed yet) or failed (UNAVAILABLE).",
            ["replica", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "tpserve_time_to_first_token_seconds",
            "From the request's arrival at the router to its first token leaving it.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tpserve_time_per_output_token_seconds",
            "Per request: (end-to-end - TTFT) / (output tokens - 1).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tpserve_inter_token_latency_seconds",
            "Gap between consecutive tokens of one request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tpserve_e2e_request_latency_seconds",
            "From arrival to the last message.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            "tpserve_request_prompt_tokens", "Prompt length per request.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generation_len = Histogram(
            "tpserve_request_generation_tokens",
            "Generated tokens per request.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tpserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "tpserve_generation_tokens", "Tokens streamed to clients.", registry=r
        )
        self.finished = Counter(
            "tpserve_requests_finished",
            "Requests that ended normally, by finish reason.",
            ["reason"],
            registry=r,
        )
        self.queue_time = Histogram(
            "tpserve_router_queue_time_seconds",
            "Time a request waited in the router's length buckets for the scheduler's credit.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.resumed = Counter(
            "tpserve_requests_resumed",
            "Requests that had streamed tokens when their scheduler was lost, resumed on another (or the "
            "restarted) one where they stopped.",
            registry=r,
        )
        # Goodput (router/slo.py): a request with objectives that finished counts as met when its TTFT and
        # TPOT were within them, else missed; refused ones are in tpserve_requests_failed.
        self.slo = Counter(
            "tpserve_requests_slo",
            "Finished requests with latency objectives, by length bucket, priority and outcome (met/missed).",
            ["bucket", "priority", "outcome"],
            registry=r,
        )
        # Multi-LoRA (vLLM counts its own per adapter): labelled only by names the router serves.
        self.lora_requests = Counter(
            "tpserve_lora_requests", "Requests per LoRA adapter served.", ["lora_name"], registry=r
        )
        self.lora_in_flight = Gauge(
            "tpserve_lora_requests_in_flight",
            "Requests on each LoRA adapter now (queued or running).",
            ["lora_name"],
            registry=r,
        )
        self.failed = Counter(
            "tpserve_requests_failed",
            "Requests answered with an error, by gRPC status code.",
            ["code"],
            registry=r,
        )

    def watch_replicas(self, pool) -> None:
        """Per-replica gauges read pool.replicas at scrape time."""
        self._replicas.pool = pool

    def count_failover(self, replica: str, resent: int, failed: int) -> None:
        self.failovers.labels(replica=replica, outcome="resent").inc(resent)
        self.failovers.labels(replica=replica, outcome="failed").inc(failed)
