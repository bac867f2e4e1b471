"""The router's Prometheus metrics: what a client sees of each request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
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
        self.failed = Counter(
            "tpserve_requests_failed",
            "Requests answered with an error, by gRPC status code.",
            ["code"],
            registry=r,
        )
