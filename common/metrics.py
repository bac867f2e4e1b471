"""Prometheus metrics: each process defines its own (in its folder) and serves them with this."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

# Latency buckets from 1 ms to 60 s: TTFT and TPOT targets (100 ms, 20 ms) sit well inside.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0,
)  # fmt: skip
# Token counts (prompt and generation lengths, tokens per step) up to 8k.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def serve(registry: CollectorRegistry, host: str, port: int | None) -> int | None:
    """Serves /metrics on host:port (0: any free port); returns the bound port, or None when off."""
    if port is None or port < 0:
        return None
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port


def add_arguments(p) -> None:
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any free port)"
    )
