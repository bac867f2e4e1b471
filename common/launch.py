"""`tpserve launch`'s own settings and command line. The router's, the scheduler's and the workers' flags
marked launch=True are launch's flags too: their configurations are imported here, by the launcher
alone; each process imports only its own (common/cli.py). The supervision is common/launcher.py's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from common import security, settings, tracing
from common.security import ClientAuth, TlsFiles
from common.settings import above, at_least, setting
from common.tracing import TracingConfig


@dataclass(frozen=True)
class LaunchConfig:
    """What `tpserve launch` decides itself. The processes' own settings reach them as flags: the router's,
    the scheduler's and the workers' fields declared with launch=True (common/settings.py) are launch's
    flags too, and their values are passed through in router_args, scheduler_args and worker_args."""

    model: str  # the checkpoint, for the check below (it also travels in router_args and worker_args)
    tp: int = setting(1, help="tensor_parallel_size: shard workers, one per device", rule=at_least(1))
    replicas: int = setting(
        1, help="model replicas (a scheduler and --tp workers each) behind the router", rule=at_least(1)
    )
    ready_file: str | None = setting(None, help="write {target, pids, http_port} as JSON here once serving")
    startup_timeout_s: float = setting(
        600.0, flag="--startup-timeout", help="seconds to wait for SERVING", rule=above(0)
    )
    max_restarts: int = setting(
        0,
        help="restart a dead scheduler or worker group this many times (0: a death stops the launch)",
        rule=at_least(0),
    )
    host: str = "127.0.0.1"  # the router's (its --host, in router_args)
    device: str = "cpu"  # the workers' (in worker_args), for check_machine
    router_ports: tuple[tuple[str, int | None], ...] = ()  # (flag, port): the router's, for check_machine
    log_level: str = "INFO"
    log_format: str = "text"
    scheduler_args: tuple[str, ...] = field(default_factory=tuple)  # passed through unchanged
    router_args: tuple[str, ...] = field(default_factory=tuple)
    worker_args: tuple[str, ...] = field(default_factory=tuple)
    router_drain_s: float = 30.0  # the router's --drain-timeout-s: stopping waits that long for it
    metrics_port: int | None = None  # the router's; the others bind free ports and are logged
    tracing: TracingConfig = field(default_factory=TracingConfig)
    tls: TlsFiles | None = None  # the router's public port
    internal_tls: TlsFiles | None = None  # mutual TLS between every process, each given the same files
    # How the launcher's readiness check reaches the router: like any client (health needs no API key).
    health_auth: ClientAuth = field(default_factory=ClientAuth)

    def __post_init__(self):
        settings.validate(self)
        if self.tls is not None and self.tls.ca and not self.health_auth.cert:
            raise ValueError(
                "--tls-client-ca makes clients present certificates, the launcher's readiness check too: "
                "give it one with --tls-client-cert and --tls-client-key"
            )
        # A .gguf file: each process reads it (common/gguf_model.py).
        if not self.model.endswith(".gguf") and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there (run `make model`?)")


def _process_configs():
    from router.config import RouterConfig
    from scheduler.config import SchedulerConfig
    from shard_worker.config import WorkerConfig

    return WorkerConfig, RouterConfig, SchedulerConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    # The router's, scheduler's and workers' flags marked launch=True, declared once in their configs.
    for config in _process_configs():
        settings.add_arguments(p, config, launch_only=True)
    settings.add_arguments(p, LaunchConfig)
    p.add_argument(
        "--metrics-port", type=int, default=None, help="router /metrics port; the others' are logged (0: any)"
    )
    tracing.add_arguments(p)
    # The router's public TLS, passed through; the internal mutual TLS, given to every process.
    security.add_public_arguments(p)
    security.add_internal_arguments(p)
    security.add_client_arguments(p, api_key=False, title="launch's readiness check of the router's TLS port")


def main(a: argparse.Namespace) -> int:
    from common.launcher import launch

    if (a.speculative_method == "draft") != bool(a.speculative_model):
        raise ValueError("--speculative-method draft and --speculative-model DIR go together")
    worker, router, scheduler = _process_configs()
    return launch(
        settings.from_args(
            LaunchConfig,
            a,
            model=a.model,
            host=a.host,
            device=a.device,
            router_ports=(
                ("--port", a.port),
                ("--http-port", a.http_port),
                ("--metrics-port", a.metrics_port),
            ),
            log_level=a.log_level,
            log_format=a.log_format,
            scheduler_args=tuple(settings.to_argv(a, scheduler)),
            router_args=tuple(settings.to_argv(a, router)),
            worker_args=tuple(settings.to_argv(a, worker)),
            router_drain_s=a.drain_timeout_s,
            metrics_port=a.metrics_port,
            tracing=tracing.from_args(a),
            tls=security.public_from_args(a),
            internal_tls=security.internal_from_args(a),
            health_auth=security.client_from_args(a),
        )
    )
