"""`tpserve launch`: the whole stack on one machine, as separate OS processes.

Starts the shard workers (one per rank), the scheduler and the router, each binding a free port and
reporting it through a file (no race over "free" ports), waits until the router's health is SERVING,
then watches them: a child that dies takes the stack down with an error naming it; SIGINT/SIGTERM
stop every child, router first so clients see the drain before the workers go.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from common import security, tracing
from common.grpc_util import free_port, read_port_file, wait_for_health
from common.security import ClientAuth, TlsFiles
from common.tracing import TracingConfig

log = logging.getLogger("tpserve.launch")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Children get SIGTERM if the launcher itself is killed, so no orphan holds a port or a GPU."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass(frozen=True)
class LaunchConfig:
    model: str
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    dtype: str = "float32"
    ready_file: str | None = None
    startup_timeout_s: float = 600.0
    log_level: str = "INFO"
    log_format: str = "text"
    scheduler_args: tuple[str, ...] = field(default_factory=tuple)  # passed through unchanged
    router_args: tuple[str, ...] = field(default_factory=tuple)
    router_drain_s: float = 30.0  # the router's --drain-timeout-s: stopping waits that long for it
    metrics_port: int | None = None  # the router's; the others bind free ports and are logged
    # A scheduler or worker group that dies is started again this many times (0: the launch ends).
    max_restarts: int = 0
    tracing: TracingConfig = field(default_factory=TracingConfig)
    tls: TlsFiles | None = None  # the router's public port
    internal_tls: TlsFiles | None = None  # mutual TLS between every process, each given the same files
    api_key_file: str | None = None  # the router's
    # How the launcher's readiness check reaches the router: like any client (health needs no API key).
    health_auth: ClientAuth = field(default_factory=ClientAuth)

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"--tp must be at least 1, got {self.tp}")
        if self.tls is not None and self.tls.ca and not self.health_auth.cert:
            raise ValueError(
                "--tls-client-ca makes clients present certificates, the launcher's readiness check too: "
                "give it one with --tls-client-cert and --tls-client-key"
            )
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there (run `make model`?)")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    args: list[str]  # to start it again on the same port
    port_file: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class Stack:
    def __init__(self, config: LaunchConfig):
        self.config = config
        self.children: list[Child] = []
        self.metrics: dict[str, int] = {}  # child name -> its /metrics port
        self.tmp = Path(tempfile.mkdtemp(prefix="tpserve-"))

    def _spawn(self, name: str, args: list[str], port_file: Path) -> Child:
        cfg = self.config
        cmd = [
            sys.executable,
            "-m",
            "common.cli",
            "--log-level",
            cfg.log_level,
            "--log-format",
            cfg.log_format,
        ]
        cmd += [*args, *tracing.flags(cfg.tracing), *security.internal_flags(cfg.internal_tls)]
        if cfg.metrics_port is not None:
            cmd += ["--metrics-port", str(cfg.metrics_port if name == "router" else 0)]
        port_file.unlink(missing_ok=True)
        # Own session: a Ctrl-C in the terminal reaches only the launcher, which stops children in order.
        proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent, start_new_session=True)
        child = Child(name, proc, args, port_file)
        self.children.append(child)
        log.info("started %s (pid %d)", name, proc.pid)
        return child

    def _port_of(self, child: Child) -> int:
        try:
            ports = read_port_file(child.port_file, self.config.startup_timeout_s, lambda: child.alive)
        except RuntimeError:
            raise RuntimeError(
                f"{child.name} exited with code {child.proc.returncode} while starting"
            ) from None
        if ports.get("metrics_port") is not None:
            self.metrics[child.name] = ports["metrics_port"]
            log.info("%s metrics on http://127.0.0.1:%d/metrics", child.name, ports["metrics_port"])
        return ports["port"]

    def _worker_args(self, rank: int, dist_init: str, port: int) -> list[str]:
        cfg = self.config
        args = ["shard-worker", "--model", cfg.model, "--rank", str(rank), "--world-size", str(cfg.tp)]
        args += ["--dist-init", dist_init, "--device", cfg.device, "--dtype", cfg.dtype]
        return args + ["--port", str(port), "--port-file", str(self.tmp / f"worker{rank}.port")]

    def _start_workers(self, ports: list[int]) -> list[int]:
        # A fresh rendezvous port each time: a restarted group must not meet the old store.
        dist_init = f"127.0.0.1:{free_port()}"
        workers = []
        for rank, port in enumerate(ports):
            args = self._worker_args(rank, dist_init, port)
            workers.append(self._spawn(f"shard-worker rank {rank}", args, self.tmp / f"worker{rank}.port"))
        return [self._port_of(c) for c in workers]

    def start(self) -> str:
        cfg = self.config
        self.worker_ports = self._start_workers([0] * cfg.tp)
        worker_addrs = [f"127.0.0.1:{port}" for port in self.worker_ports]

        port_file = self.tmp / "scheduler.port"
        args = ["scheduler", "--port", "0", "--port-file", str(port_file), *cfg.scheduler_args]
        for addr in worker_addrs:
            args += ["--worker", addr]
        scheduler = self._spawn("scheduler", args, port_file)
        self.scheduler_port = self._port_of(scheduler)
        scheduler_addr = f"127.0.0.1:{self.scheduler_port}"

        port_file = self.tmp / "router.port"
        args = ["router", "--scheduler", scheduler_addr, "--model", cfg.model]
        args += ["--host", cfg.host, "--port", str(cfg.port), "--port-file", str(port_file), *cfg.router_args]
        args += security.public_flags(cfg.tls)
        if cfg.api_key_file:
            args += ["--api-key-file", cfg.api_key_file]
        router = self._spawn("router", args, port_file)
        router_addr = f"{'127.0.0.1' if cfg.host == '0.0.0.0' else cfg.host}:{self._port_of(router)}"

        dead = self.first_dead
        auth = replace(cfg.health_auth, tls=cfg.tls is not None)
        wait_for_health(
            router_addr,
            cfg.startup_timeout_s,
            alive=lambda: dead() is None,
            credentials=auth.credentials(),
            options=auth.options(),
        )
        return router_addr

    def restart(self, dead: Child) -> None:
        """Starts a dead scheduler, or the whole worker group after any rank died (a process group
        cannot take a new member), on the same ports, so the others reconnect by themselves."""
        self.children.remove(dead)
        if dead.name == "scheduler":
            args = list(dead.args)
            args[args.index("--port") + 1] = str(self.scheduler_port)
            self._port_of(self._spawn("scheduler", args, dead.port_file))
            return
        workers = [c for c in self.children if c.name.startswith("shard-worker")]
        self._terminate(workers, grace_s=5.0)
        for c in workers:
            self.children.remove(c)
        self._start_workers(self.worker_ports)

    def _terminate(self, children: list[Child], grace_s: float) -> None:
        for child in children:
            if child.alive:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0fs: killing it", child.name, grace_s)
                    child.proc.kill()
                    child.proc.wait()

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive), None)

    def stop(self, grace_s: float = 10.0) -> None:
        """Router first (it drains: its own timeout bounds that), then the scheduler, then the workers."""
        for child in reversed(self.children):
            self._terminate(
                [child], grace_s + (self.config.router_drain_s if child.name == "router" else 0.0)
            )
        for f in self.tmp.iterdir():
            f.unlink()
        self.tmp.rmdir()


def launch(config: LaunchConfig) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(config)
    try:
        try:
            target = stack.start()
        except (RuntimeError, TimeoutError) as e:
            if stop.is_set():
                return 0
            log.error("start-up failed: %s", e)
            return 1
        log.info("tpserve serving on %s (tensor_parallel_size %d); Ctrl-C stops it", target, config.tp)
        if config.ready_file:
            info = {
                "target": target,
                "pids": {c.name: c.proc.pid for c in stack.children},
                "metrics_ports": stack.metrics,
                # Internal ports, for tests and tools that talk to a process directly.
                "scheduler": f"127.0.0.1:{stack.scheduler_port}",
                "workers": [f"127.0.0.1:{port}" for port in stack.worker_ports],
            }
            tmp = Path(f"{config.ready_file}.tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, config.ready_file)
        restarts = 0
        while not stop.wait(0.2):
            dead = stack.first_dead()
            if dead is None:
                continue
            what = f"{dead.name} (pid {dead.proc.pid}) exited with code {dead.proc.returncode}"
            if dead.name == "router" or restarts >= config.max_restarts:
                log.error("%s: stopping", what)
                return 1
            restarts += 1
            log.warning("%s: restarting it (restart %d of %d)", what, restarts, config.max_restarts)
            try:
                stack.restart(dead)
            except (RuntimeError, TimeoutError) as e:
                log.error("restart failed: %s", e)
                return 1
        log.info("stopping")
        return 0
    finally:
        stack.stop()
        time.sleep(0)  # let log lines flush in order
