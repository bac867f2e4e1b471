"""The router's Prometheus metrics: what a client sees of each request."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from common.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS


class _BucketCollector:
    """Waiting requests and the oldest wait per length bucket, read at scrape time."""

    def __init__(self, admission):
        self.admission = admission

    def collect(self):
        waiting = GaugeMetricFamily(
            "tpserve_router_queue_waiting_requests", "Requests waiting per length bucket.", labels=["bucket"]
        )
        oldest = GaugeMetricFamily(
            "tpserve_router_queue_oldest_wait_seconds", "Oldest wait per length bucket.", labels=["bucket"]
        )
        for b in self.admission.stats(time.monotonic()):
            waiting.add_metric([b.name], b.waiting)
            oldest.add_metric([b.name], b.oldest_wait_s)
        yield waiting
        yield oldest


class RouterMetrics:
    def __init__(self, admission=None):
        r = self.registry = CollectorRegistry()
        if admission is not None:
            r.register(_BucketCollector(admission))
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
        self.failed = Counter(
            "tpserve_requests_failed",
            "Requests answered with an error, by gRPC status code.",
            ["code"],
            registry=r,
        )
