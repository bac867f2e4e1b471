"""The shard worker's configuration: built once from the command line, validated, frozen."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from common import metrics, security, tracing
from common.security import TlsFiles
from common.tracing import TracingConfig

DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    rank: int = 0
    world_size: int = 1
    dist_init: str = ""  # host:port of rank 0's torch.distributed store; needed when world_size > 1
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str | None = None
    device: str = "cpu"  # cpu or cuda (the rank picks cuda:<local rank>)
    dtype: str = "float32"
    num_threads: int = 0  # CPU threads for torch; 0: the cores divided among the ranks
    metrics_port: int | None = None
    tracing: TracingConfig = TracingConfig()
    internal_tls: TlsFiles | None = None  # mutual TLS: only a scheduler with a certificate gets in

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"--rank {self.rank} must be in [0, --world-size {self.world_size})")
        if self.world_size > 1 and ":" not in self.dist_init:
            raise ValueError("--dist-init HOST:PORT is required when --world-size > 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def threads(self) -> int:
        if self.num_threads > 0:
            return self.num_threads
        return max(1, (os.cpu_count() or 1) // self.world_size)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dist-init", default="", help="HOST:PORT of rank 0's torch.distributed store")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=0, help="0: any free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: cores / world size)")
    security.add_internal_arguments(p)
    metrics.add_arguments(p)
    tracing.add_arguments(p)


def from_args(a: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        model=a.model,
        rank=a.rank,
        world_size=a.world_size,
        dist_init=a.dist_init,
        host=a.host,
        port=a.port,
        port_file=a.port_file,
        device=a.device,
        dtype=a.dtype,
        num_threads=a.num_threads,
        metrics_port=a.metrics_port,
        tracing=tracing.from_args(a),
        internal_tls=security.internal_from_args(a),
    )
