"""The scheduler process's configuration: built once from the command line, validated, frozen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common import metrics, security, tracing
from common.security import TlsFiles
from common.tracing import TracingConfig
from scheduler.scheduler import SchedulingPolicy


@dataclass(frozen=True)
class SchedulerConfig:
    workers: tuple[str, ...]  # host:port of every rank, in rank order
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str | None = None
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: each rank profiles its memory; the pool is the minimum
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gib: float = 2.0
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the model's max_position_embeddings (capped by the KV pool)
    batching: str = "continuous"
    static_batch_size: int = 32
    static_batch_timeout_ms: float = 50.0
    enable_prefix_caching: bool = False
    # GiB of host memory per rank that preempted sequences' KV is swapped to (0: always recompute).
    swap_space: float = 0.0
    min_batch_size: int = 8
    batch_wait_timeout_ms: float = 0.0
    fallback_static: bool = False
    # Most requests held waiting here; the router's length buckets hold the rest (credit flow control).
    admission_window: int = 32
    worker_connect_timeout_s: float = 300.0
    # A step not answered by every rank within this is a lost rank (a hang, not only a crash).
    step_timeout_s: float = 120.0
    # After losing a rank, requests wait this long for it to return (then recompute and go on) before
    # they get UNAVAILABLE.
    worker_recovery_timeout_s: float = 60.0
    metrics_port: int | None = None
    tracing: TracingConfig = TracingConfig()
    # Mutual TLS on the port the router dials and on the channels to the workers.
    internal_tls: TlsFiles | None = None

    def __post_init__(self):
        if not self.workers:
            raise ValueError("at least one --worker HOST:PORT is required")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must not be negative, got {self.swap_space}")
        if self.admission_window < 1:
            raise ValueError(f"--admission-window must be at least 1, got {self.admission_window}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        # The policy checks its own fields; building one here reports bad values at start-up.
        self.policy(max_model_len=self.max_model_len or 1)

    def policy(self, max_model_len: int) -> SchedulingPolicy:
        return SchedulingPolicy(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            batching=self.batching,
            static_batch_size=self.static_batch_size,
            static_batch_timeout_s=self.static_batch_timeout_ms / 1000.0,
            min_batch_size=self.min_batch_size,
            batch_wait_timeout_s=self.batch_wait_timeout_ms / 1000.0,
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", action="append", default=[], help="HOST:PORT of a shard worker, in rank order")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=0, help="0: any free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--step-timeout-s", type=float, default=120.0, help="a rank silent this long is lost")
    p.add_argument(
        "--worker-recovery-timeout-s",
        type=float,
        default=60.0,
        help="how long requests wait for a lost rank to return before they get UNAVAILABLE",
    )
    add_policy_arguments(p)
    security.add_internal_arguments(p)
    metrics.add_arguments(p)
    tracing.add_arguments(p)


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that `tpserve launch` passes through to the scheduler unchanged."""
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks (0: profile free memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--cpu-kv-cache-gib", type=float, default=2.0, help="KV cache size per rank on CPU")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's context length")
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous")
    p.add_argument("--static-batch-size", type=int, default=32)
    p.add_argument("--static-batch-timeout-ms", type=float, default=50.0)
    p.add_argument(
        "--min-batch-size",
        type=int,
        default=8,
        help="with --batch-wait-timeout-ms: a smaller batch waits for requests on their way",
    )
    p.add_argument(
        "--batch-wait-timeout-ms",
        type=float,
        default=0.0,
        help="longest wait for min_batch_size sequences (0: never wait)",
    )
    p.add_argument(
        "--fallback-static",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="switch to static batching while throughput is 10%% below its recent baseline",
    )
    p.add_argument(
        "--admission-window",
        type=int,
        default=32,
        help="most requests waiting in the scheduler; more wait in the router's length buckets",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reuse the KV blocks of prompt prefixes already computed",
    )
    p.add_argument(
        "--swap-space",
        type=float,
        default=0.0,
        help="GiB of host memory per rank to swap preempted sequences' KV to (0: recompute them)",
    )


POLICY_FLAGS = (
    "block_size",
    "num_kv_blocks",
    "gpu_memory_utilization",
    "cpu_kv_cache_gib",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "batching",
    "static_batch_size",
    "static_batch_timeout_ms",
    "enable_prefix_caching",
    "swap_space",
    "admission_window",
    "min_batch_size",
    "batch_wait_timeout_ms",
    "fallback_static",
)


def from_args(a: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        workers=tuple(a.worker),
        host=a.host,
        port=a.port,
        port_file=a.port_file,
        metrics_port=a.metrics_port,
        tracing=tracing.from_args(a),
        step_timeout_s=a.step_timeout_s,
        worker_recovery_timeout_s=a.worker_recovery_timeout_s,
        internal_tls=security.internal_from_args(a),
        **{name: getattr(a, name) for name in POLICY_FLAGS},
    )
