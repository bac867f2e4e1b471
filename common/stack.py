"""The processes of one `tpserve launch` stack: each replica's shard workers and scheduler and the router,
spawned on free ports (each child reports its port through a file; the ports peers must know before
their owner binds are held by the launcher, grpc_util.ReservedPort), restarted on the same ports, and
stopped router first. common/launcher.py supervises them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

from common import security, tracing
from common.grpc_util import ReservedPort, read_port_file, wait_for_health
from common.launch import LaunchConfig

log = logging.getLogger("tpserve.launch")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Children get SIGTERM if the launcher itself is killed, so no orphan holds a port or a GPU."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    args: list[str]  # to start it again on the same port
    port_file: Path
    replica: int | None = None  # the model replica a scheduler or worker belongs to

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while the stack was starting."""


class Stack:
    def __init__(self, config: LaunchConfig, stopping: threading.Event | None = None):
        self.config = config
        self.stopping = stopping or threading.Event()  # set by a signal: every start-up wait ends at once
        self.children: list[Child] = []
        self.metrics: dict[str, int] = {}  # child name -> its /metrics port
        self.http_port: int | None = None  # the router's OpenAI-compatible API, when --http-port is set
        self.tmp = Path(tempfile.mkdtemp(prefix="tpserve-"))
        # Held until stop: a restarted scheduler binds its port again; replica -> its group's rendezvous.
        self.scheduler_ports: list[ReservedPort] = []
        self.rendezvous: dict[int, ReservedPort] = {}

    def _spawn(self, name: str, args: list[str], port_file: Path, replica: int | None = None) -> Child:
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
        child = Child(name, proc, args, port_file, replica)
        self.children.append(child)
        log.info("started %s (pid %d)", name, proc.pid)
        return child

    def _port_of(self, child: Child, watch: list[Child] | None = None) -> int:
        """Waits for child's port file. A death among `watch` (default: every child) ends the wait (the
        other ranks of a group wait for a failed one for minutes), raising what it wrote in its port file
        (common/cli.py) as a ValueError, or, when it died without a word, a RuntimeError. A restart
        watches only what it starts: another process dying meanwhile is the next restart's business."""
        watched = self.children if watch is None else watch

        def going() -> bool:
            return all(c.alive for c in watched) and not self.stopping.is_set()

        try:
            ports = read_port_file(child.port_file, self.config.startup_timeout_s, going)
        except RuntimeError:
            self._raise_death(watched)
        if "error" in ports:
            raise ValueError(f"{child.name}: {ports['error']}")
        if ports.get("metrics_port") is not None:
            self.metrics[child.name] = ports["metrics_port"]
            log.info("%s metrics on http://127.0.0.1:%d/metrics", child.name, ports["metrics_port"])
        if ports.get("http_port") is not None:
            self.http_port = ports["http_port"]
        return ports["port"]

    def _starting(self) -> bool:
        """Whether the start-up goes on: no child died and no signal asked to stop."""
        return self.first_dead() is None and not self.stopping.is_set()

    def _raise_death(self, watched: list[Child] | None = None) -> NoReturn:
        """Raises Interrupted when a signal ended the wait; else what the first dead child wrote in its
        port file as it exited (common/cli.py), as a ValueError; or, when it died without a word (a
        crash), a RuntimeError."""
        if self.stopping.is_set():
            raise Interrupted()
        dead = next(c for c in (self.children if watched is None else watched) if not c.alive)
        try:
            error = json.loads(dead.port_file.read_text()).get("error")
        except (OSError, ValueError):  # no file yet, or a half-written one
            error = None
        if error:
            raise ValueError(f"{dead.name}: {error}")
        raise RuntimeError(f"{dead.name} exited with code {dead.proc.returncode} while starting")

    @staticmethod
    def scheduler_name(replica: int) -> str:
        """Replica 0 keeps the names of a single-replica launch ("scheduler", "shard-worker rank 0")."""
        return "scheduler" if replica == 0 else f"scheduler {replica}"

    @staticmethod
    def worker_name(replica: int, rank: int) -> str:
        return f"shard-worker rank {rank}" if replica == 0 else f"shard-worker {replica} rank {rank}"

    def _worker_args(self, replica: int, rank: int, dist_init: str, port: int) -> list[str]:
        cfg = self.config
        args = ["shard-worker", *cfg.worker_args, "--rank", str(rank), "--world-size", str(cfg.tp)]
        args += ["--dist-init", dist_init]
        port_file = self.tmp / f"worker{replica}-{rank}.port"
        return args + ["--port", str(port), "--port-file", str(port_file)]

    def _spawn_workers(self, replica: int, ports: list[int]) -> list[Child]:
        # A fresh rendezvous port each time: a restarted group must not meet the old store.
        old, self.rendezvous[replica] = self.rendezvous.get(replica), ReservedPort()
        if old is not None:
            old.close()
        dist_init = f"127.0.0.1:{self.rendezvous[replica].port}"
        workers = []
        for rank, port in enumerate(ports):
            args = self._worker_args(replica, rank, dist_init, port)  # the port file last
            workers.append(self._spawn(self.worker_name(replica, rank), args, Path(args[-1]), replica))
        return workers

    def _spawn_scheduler(self, replica: int, port: int) -> Child:
        cfg = self.config
        port_file = self.tmp / f"scheduler{replica}.port"
        args = ["scheduler", "--port", str(port), "--port-file", str(port_file), *cfg.scheduler_args]
        for worker_port in self.worker_ports[replica]:
            args += ["--worker", f"127.0.0.1:{worker_port}"]
        return self._spawn(self.scheduler_name(replica), args, port_file, replica)

    def _spawn_router(self) -> Child:
        port_file = self.tmp / "router.port"
        args = ["router", *self.config.router_args, "--port-file", str(port_file)]
        for reserved in self.scheduler_ports:
            args += ["--scheduler", f"127.0.0.1:{reserved.port}"]
        return self._spawn("router", args + security.public_flags(self.config.tls), port_file)

    def start(self) -> str:
        cfg = self.config
        # The workers and the router start at once (importing torch and loading the model, and the router's
        # imports and tokenizer, are most of the time; 7.5 s -> 3.9 s for the tiny model); each scheduler
        # once its workers listen, on a port chosen first so that the router can be told it. With several
        # replicas the router starts last, so that it is SERVING with every replica connected. Phases are
        # logged with the seconds since self.started (each rank logs its own).
        self.started = time.monotonic()
        self.scheduler_ports = [ReservedPort() for _ in range(cfg.replicas)]
        groups = [self._spawn_workers(i, [0] * cfg.tp) for i in range(cfg.replicas)]
        router = self._spawn_router() if cfg.replicas == 1 else None
        self.worker_ports = [[self._port_of(c) for c in group] for group in groups]
        self._log_phase("every rank has loaded its weights")
        for i, reserved in enumerate(self.scheduler_ports):
            self._port_of(self._spawn_scheduler(i, reserved.port))
        self._log_phase("the scheduler(s) listen, and describe the workers (which warm up)")
        router = router or self._spawn_router()
        router_addr = f"{'127.0.0.1' if cfg.host == '0.0.0.0' else cfg.host}:{self._port_of(router)}"
        self._log_phase("the router listens")

        auth = replace(cfg.health_auth, tls=cfg.tls is not None)
        try:
            wait_for_health(
                router_addr,
                cfg.startup_timeout_s,
                alive=self._starting,
                credentials=auth.credentials(),
                options=auth.options(),
            )
        except RuntimeError:
            self._raise_death()
        return router_addr

    def _log_phase(self, what: str) -> None:
        log.info("start-up: %s, %.1fs after launch", what, time.monotonic() - self.started)

    def restart(self, dead: Child) -> None:
        """Starts a dead scheduler, or the whole worker group of its replica after any rank died (a
        process group cannot take a new member), on the same ports, so the others reconnect by
        themselves. Other replicas are not touched."""
        self.children.remove(dead)
        replica = dead.replica
        if dead.name == self.scheduler_name(replica):
            scheduler = self._spawn_scheduler(replica, self.scheduler_ports[replica].port)
            self._port_of(scheduler, [scheduler])
            return
        workers = [c for c in self.children if c.replica == replica and c.name.startswith("shard-worker")]
        self._terminate(workers, grace_s=5.0)
        for c in workers:
            self.children.remove(c)
        group = self._spawn_workers(replica, self.worker_ports[replica])
        for c in group:
            self._port_of(c, group)

    def live_replicas(self) -> int:
        return len({c.replica for c in self.children if c.replica is not None})

    def abandon(self, replica: int) -> None:
        """Stops what is left of a replica that cannot be restarted; the router routes around it."""
        group = [c for c in self.children if c.replica == replica]
        self._terminate(group, grace_s=5.0)
        for c in group:
            self.children.remove(c)

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
        """Router first (it drains: its own timeout bounds that), then the schedulers, then the workers.
        By role, not start order: a restarted child is last in the list but not last to stop."""

        def order(child: Child) -> int:
            return 0 if child.name == "router" else 1 if child.name.startswith("scheduler") else 2

        for child in sorted(self.children, key=order):
            self._terminate(
                [child], grace_s + (self.config.router_drain_s if child.name == "router" else 0.0)
            )
        for reserved in [*self.scheduler_ports, *self.rendezvous.values()]:
            reserved.close()
        for f in self.tmp.iterdir():
            f.unlink()
        self.tmp.rmdir()
