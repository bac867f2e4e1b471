"""The scheduler process's configuration: built once from the command line, validated, frozen.

Each field declared with `setting` is also the flag of the same name (common/settings.py); those marked
launch=True are taken by `tpserve launch` too and passed through. The batching knobs are the nested
SchedulingPolicy's (scheduler/policy.py), speculative decoding's the nested SpeculativePolicy's
(scheduler/speculation.py), each declared there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from common import metrics, security, settings, tracing
from common.security import TlsFiles
from common.settings import POWER_OF_TWO, above, at_least, between, nested, setting
from common.tracing import TracingConfig
from scheduler.scheduler import SchedulingPolicy
from scheduler.speculation import SpeculativePolicy


@dataclass(frozen=True)
class SchedulerConfig:
    workers: tuple[str, ...] = setting((), flag="--worker", help="HOST:PORT of a shard worker, in rank order")
    host: str = setting("127.0.0.1", help="address to bind (loopback unless told otherwise)")
    port: int = setting(0, help="0: any free port (see --port-file)", rule=at_least(0))
    port_file: str | None = setting(None, help="write the bound port here once serving")
    block_size: int = setting(16, help="tokens per KV block", rule=POWER_OF_TWO, launch=True)
    num_kv_blocks: int = setting(
        0,
        help="KV blocks of every layer (0: each rank profiles its memory); a model with sliding-window "
        "layer groups gets as many of its smaller blocks as that memory holds",
        rule=at_least(0),
        launch=True,
    )
    gpu_memory_utilization: float = setting(
        0.85,
        help="share of device memory a rank may fill: weights, activations and KV cache",
        rule=between(0, 1, low_open=True),
        launch=True,
    )
    cpu_kv_cache_gib: float = setting(
        2.0, help="KV cache size per rank on CPU, in GiB", rule=above(0), launch=True
    )
    enable_prefix_caching: bool = setting(
        False, help="reuse the KV blocks of prompt prefixes already computed", launch=True
    )
    swap_space: float = setting(
        0.0,
        help="GiB of host memory per rank to swap preempted sequences' KV to (0: recompute them)",
        rule=at_least(0),
        launch=True,
    )
    host_prefix_cache: bool = setting(
        False,
        help="keep full prefix blocks evicted from the device in the swap space (host memory, least "
        "recently used evicted, and whenever a preempted sequence needs the room) and copy them back "
        "instead of recomputing them; needs --enable-prefix-caching and --swap-space",
        launch=True,
    )
    fallback_static: bool = setting(
        False, help="switch to static batching while throughput is 10% below its recent baseline", launch=True
    )
    async_scheduling: bool = setting(
        False,
        help="plan and send the next step while the ranks run this one (vLLM's async scheduling, "
        "SGLang's overlap loop): hides the scheduler's host work and the hop to the ranks behind the "
        "forward; steps with a grammar run serially; not with speculative decoding",
        launch=True,
    )
    admission_window: int = setting(
        32,
        help="most requests waiting in the scheduler; more wait in the router's length buckets (a pooling "
        "model: at least --max-num-seqs, one sequence an input)",
        rule=at_least(1),
        launch=True,
    )
    worker_connect_timeout_s: float = setting(
        300.0, help="how long to wait for the shard workers at start-up", rule=above(0)
    )
    step_timeout_s: float = setting(
        120.0,
        help="a rank that does not answer a step within this is lost (a hang, not only a crash)",
        rule=above(0),
    )
    worker_recovery_timeout_s: float = setting(
        60.0,
        help="how long requests wait for a lost rank to return before they get UNAVAILABLE",
        rule=above(0),
    )
    # The adapters the workers serve (the worker reads them; the scheduler refuses any other name).
    enable_lora: bool = setting(False, help="serve LoRA adapters (--lora-modules)", launch=True)
    lora_modules: tuple[str, ...] = setting((), help="a LoRA adapter to serve, NAME=PATH", launch=True)
    policy: SchedulingPolicy = nested(SchedulingPolicy)
    speculative: SpeculativePolicy = nested(SpeculativePolicy)
    metrics_port: int | None = None
    tracing: TracingConfig = TracingConfig()
    # Mutual TLS on the port the router dials and on the channels to the workers.
    internal_tls: TlsFiles | None = None

    def __post_init__(self):
        settings.validate(self)
        if not self.workers:
            raise ValueError("at least one --worker HOST:PORT is required")
        if self.host_prefix_cache and not (self.enable_prefix_caching and self.swap_space > 0):
            raise ValueError("--host-prefix-cache needs --enable-prefix-caching and --swap-space > 0")
        if self.async_scheduling and self.speculative.enabled:
            raise ValueError(
                "--async-scheduling cannot be combined with speculative decoding: a step's proposals "
                "need the tokens the step before it sampled"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")

    def resolved_policy(self, max_model_len: int) -> SchedulingPolicy:
        """The policy with max_model_len settled (the model's, capped by the KV pool: see capacity.py)."""
        return replace(self.policy, max_model_len=max_model_len)


def add_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_arguments(p, SchedulerConfig)
    security.add_internal_arguments(p)
    metrics.add_arguments(p)
    tracing.add_arguments(p)


def from_args(a: argparse.Namespace) -> SchedulerConfig:
    return settings.from_args(
        SchedulerConfig,
        a,
        metrics_port=a.metrics_port,
        tracing=tracing.from_args(a),
        internal_tls=security.internal_from_args(a),
    )
