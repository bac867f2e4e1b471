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
from dataclasses import dataclass, field
from pathlib import Path

from common import tracing
from common.grpc_util import free_port, read_port_file, wait_for_health
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
    metrics_port: int | None = None  # the router's; the others bind free ports and are logged
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"--tp must be at least 1, got {self.tp}")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there (run `make model`?)")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class Stack:
    def __init__(self, config: LaunchConfig):
        self.config = config
        self.children: list[Child] = []
        self.metrics: dict[str, int] = {}  # child name -> its /metrics port
        self.tmp = Path(tempfile.mkdtemp(prefix="tpserve-"))

    def _spawn(self, name: str, args: list[str]) -> Child:
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
        cmd += [*args, *tracing.flags(cfg.tracing)]
        if cfg.metrics_port is not None:
            cmd += ["--metrics-port", str(cfg.metrics_port if name == "router" else 0)]
        proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
        child = Child(name, proc)
        self.children.append(child)
        log.info("started %s (pid %d)", name, proc.pid)
        return child

    def _port_of(self, child: Child, port_file: Path) -> int:
        try:
            ports = read_port_file(port_file, self.config.startup_timeout_s, lambda: child.alive)
        except RuntimeError:
            raise RuntimeError(
                f"{child.name} exited with code {child.proc.returncode} while starting"
            ) from None
        if ports.get("metrics_port") is not None:
            self.metrics[child.name] = ports["metrics_port"]
            log.info("%s metrics on http://127.0.0.1:%d/metrics", child.name, ports["metrics_port"])
        return ports["port"]

    def start(self) -> str:
        cfg = self.config
        dist_init = f"127.0.0.1:{free_port()}"
        workers = []
        for rank in range(cfg.tp):
            port_file = self.tmp / f"worker{rank}.port"
            args = ["shard-worker", "--model", cfg.model, "--rank", str(rank), "--world-size", str(cfg.tp)]
            args += ["--dist-init", dist_init, "--device", cfg.device, "--dtype", cfg.dtype]
            args += ["--port", "0", "--port-file", str(port_file)]
            workers.append((self._spawn(f"shard-worker rank {rank}", args), port_file))
        worker_addrs = [f"127.0.0.1:{self._port_of(c, f)}" for c, f in workers]

        port_file = self.tmp / "scheduler.port"
        args = ["scheduler", "--port", "0", "--port-file", str(port_file), *cfg.scheduler_args]
        for addr in worker_addrs:
            args += ["--worker", addr]
        scheduler = self._spawn("scheduler", args)
        scheduler_addr = f"127.0.0.1:{self._port_of(scheduler, port_file)}"

        port_file = self.tmp / "router.port"
        args = ["router", "--scheduler", scheduler_addr, "--model", cfg.model]
        args += ["--host", cfg.host, "--port", str(cfg.port), "--port-file", str(port_file)]
        router = self._spawn("router", args)
        router_addr = (
            f"{'127.0.0.1' if cfg.host == '0.0.0.0' else cfg.host}:{self._port_of(router, port_file)}"
        )

        dead = self.first_dead
        wait_for_health(router_addr, cfg.startup_timeout_s, alive=lambda: dead() is None)
        return router_addr

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive), None)

    def stop(self, grace_s: float = 10.0) -> None:
        """Router first (it drains), then the scheduler, then the workers."""
        for child in reversed(self.children):
            if child.alive:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0fs: killing it", child.name, grace_s)
                    child.proc.kill()
                    child.proc.wait()
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
            }
            tmp = Path(f"{config.ready_file}.tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, config.ready_file)
        while not stop.wait(0.2):
            dead = stack.first_dead()
            if dead is not None:
                log.error(
                    "%s (pid %d) exited with code %s: stopping",
                    dead.name,
                    dead.proc.pid,
                    dead.proc.returncode,
                )
                return 1
        log.info("stopping")
        return 0
    finally:
        stack.stop()
        time.sleep(0)  # let log lines flush in order
