"""The router's configuration: built once from the command line, validated, frozen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common import metrics, tracing
from common.tracing import TracingConfig


@dataclass(frozen=True)
class RouterConfig:
    scheduler: str  # host:port
    model: str  # checkpoint directory: the tokenizer is read from it
    host: str = "127.0.0.1"
    port: int = 50051
    port_file: str | None = None
    scheduler_retry_s: float = 0.5
    # SIGTERM: stop taking requests, let those in flight finish for up to this long, then exit.
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None
    tracing: TracingConfig = TracingConfig()

    def __post_init__(self):
        if ":" not in self.scheduler:
            raise ValueError(f"--scheduler must be HOST:PORT, got {self.scheduler!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", required=True, help="HOST:PORT of the scheduler")
    p.add_argument("--model", required=True, help="checkpoint directory (for the tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 to serve other hosts")
    p.add_argument("--port", type=int, default=50051, help="0: any free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long requests in flight may finish",
    )
    metrics.add_arguments(p)
    tracing.add_arguments(p)


def from_args(a: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        scheduler=a.scheduler,
        model=a.model,
        host=a.host,
        port=a.port,
        port_file=a.port_file,
        metrics_port=a.metrics_port,
        tracing=tracing.from_args(a),
        drain_timeout_s=a.drain_timeout_s,
    )
