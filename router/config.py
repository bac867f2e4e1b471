"""The router's configuration: built once from the command line, validated, frozen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common import metrics, security, tracing
from common.security import TlsFiles
from common.tracing import TracingConfig
from router.buckets import check_edges


@dataclass(frozen=True)
class RouterConfig:
    model: str  # checkpoint directory: the tokenizer is read from it
    # The replicas: schedulers' HOST:PORT, or a NAME:PORT whose addresses are the schedulers (a
    # Kubernetes headless Service), re-resolved every dns_interval_s. One of the two.
    schedulers: tuple[str, ...] = ()
    scheduler_dns: str | None = None
    dns_interval_s: float = 5.0
    host: str = "127.0.0.1"
    port: int = 50051
    port_file: str | None = None
    scheduler_retry_s: float = 0.5
    # SIGTERM: stop taking requests, let those in flight finish for up to this long, then exit.
    drain_timeout_s: float = 30.0
    # Length buckets (prompt tokens) and admission control: see router/buckets.py.
    bucket_edges: tuple[int, ...] = (512, 2048)
    max_queued_requests: int = 1024
    max_queue_wait_ms: float = 2000.0
    # Operator caps on request size (0: only the model's max_model_len bounds them).
    max_prompt_tokens: int = 0
    max_new_tokens_limit: int = 0
    # Routing among replicas (router/replicas.py): requests sharing their first prefix_affinity_blocks
    # KV blocks go to the replica that served that prefix, unless it is much busier.
    prefix_affinity: bool = False
    prefix_affinity_blocks: int = 4
    # A replica silent this long is down (schedulers report at least every 0.5 s).
    replica_stale_s: float = 3.0
    metrics_port: int | None = None
    tracing: TracingConfig = TracingConfig()
    tls: TlsFiles | None = None  # the public port; tls.ca set: clients must present certificates
    internal_tls: TlsFiles | None = None  # mutual TLS to the scheduler
    # Keys clients must send as `authorization: Bearer <key>`; read in serve(), so never held here.
    api_key_file: str | None = None

    def __post_init__(self):
        if self.max_prompt_tokens < 0 or self.max_new_tokens_limit < 0:
            raise ValueError("--max-prompt-tokens and --max-new-tokens-limit must be >= 0 (0: no cap)")
        check_edges(self.bucket_edges)
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be at least 1, got {self.max_queued_requests}")
        if not 0 <= self.max_queue_wait_ms < float("inf"):
            raise ValueError(f"--max-queue-wait-ms must be finite and >= 0, got {self.max_queue_wait_ms}")
        if bool(self.schedulers) == bool(self.scheduler_dns):
            raise ValueError("give --scheduler (repeatable) or --scheduler-dns, not both and not neither")
        for target in (*self.schedulers, *([self.scheduler_dns] if self.scheduler_dns else [])):
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--scheduler and --scheduler-dns take HOST:PORT, got {target!r}")
        if len(set(self.schedulers)) != len(self.schedulers):
            raise ValueError(f"--scheduler given twice for the same address: {self.schedulers}")
        if self.prefix_affinity_blocks < 1:
            raise ValueError(
                f"--prefix-affinity-blocks must be at least 1, got {self.prefix_affinity_blocks}"
            )
        if not 0 < self.dns_interval_s < float("inf"):
            raise ValueError(f"--scheduler-dns-interval-s must be finite and > 0, got {self.dns_interval_s}")
        if not 0 < self.replica_stale_s < float("inf"):
            raise ValueError(f"--replica-stale-s must be finite and > 0, got {self.replica_stale_s}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scheduler",
        action="append",
        default=[],
        help="HOST:PORT of a replica's scheduler (repeatable: one per replica)",
    )
    p.add_argument(
        "--scheduler-dns",
        default=None,
        help="NAME:PORT whose addresses are the schedulers (a headless Service), re-resolved periodically",
    )
    p.add_argument(
        "--scheduler-dns-interval-s", type=float, default=5.0, help="how often --scheduler-dns is resolved"
    )
    p.add_argument("--model", required=True, help="checkpoint directory (for the tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 to serve other hosts")
    p.add_argument("--port", type=int, default=50051, help="0: any free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    add_policy_arguments(p)
    add_security_arguments(p)
    security.add_internal_arguments(p)
    metrics.add_arguments(p)
    tracing.add_arguments(p)


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    """The public port's TLS and API keys (`tpserve launch` passes them through)."""
    security.add_public_arguments(p)
    p.add_argument(
        "--api-key-file",
        default=None,
        help="require `authorization: Bearer <key>` with a key from this file (one a line, # comments)",
    )


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that `tpserve launch` passes through to the router unchanged."""
    p.add_argument(
        "--max-prompt-tokens", type=int, default=0, help="longest prompt accepted (0: max_model_len - 1)"
    )
    p.add_argument(
        "--max-new-tokens-limit",
        type=int,
        default=0,
        help="largest max_new_tokens accepted (0: whatever fits in max_model_len)",
    )
    p.add_argument(
        "--bucket-edges",
        type=lambda t: tuple(int(x) for x in t.split(",") if x),
        default=(512, 2048),
        help="prompt-length bucket edges in tokens, comma-separated (shortest bucket admitted first)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting in the router at most; past that new ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-queue-wait-ms",
        type=float,
        default=2000.0,
        help="a request waiting longer than this is admitted before any newer one (no starvation)",
    )
    p.add_argument(
        "--prefix-affinity",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="send requests sharing a prompt prefix to the replica that served it (its prefix cache)",
    )
    p.add_argument(
        "--prefix-affinity-blocks",
        type=int,
        default=4,
        help="the prefix --prefix-affinity compares, in KV blocks (of 16 tokens by default)",
    )
    p.add_argument(
        "--replica-stale-s",
        type=float,
        default=3.0,
        help="a replica that sends no load report for this long is down and its requests move",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long requests in flight may finish",
    )


POLICY_FLAGS = (
    "max_prompt_tokens",
    "max_new_tokens_limit",
    "bucket_edges",
    "max_queued_requests",
    "max_queue_wait_ms",
    "prefix_affinity",
    "prefix_affinity_blocks",
    "replica_stale_s",
    "drain_timeout_s",
)


def from_args(a: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        model=a.model,
        schedulers=tuple(a.scheduler),
        scheduler_dns=a.scheduler_dns,
        dns_interval_s=a.scheduler_dns_interval_s,
        prefix_affinity=a.prefix_affinity,
        prefix_affinity_blocks=a.prefix_affinity_blocks,
        replica_stale_s=a.replica_stale_s,
        host=a.host,
        port=a.port,
        port_file=a.port_file,
        metrics_port=a.metrics_port,
        tracing=tracing.from_args(a),
        drain_timeout_s=a.drain_timeout_s,
        bucket_edges=a.bucket_edges,
        max_queued_requests=a.max_queued_requests,
        max_queue_wait_ms=a.max_queue_wait_ms,
        max_prompt_tokens=a.max_prompt_tokens,
        max_new_tokens_limit=a.max_new_tokens_limit,
        tls=security.public_from_args(a),
        internal_tls=security.internal_from_args(a),
        api_key_file=a.api_key_file,
    )
