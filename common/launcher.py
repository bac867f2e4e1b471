"""`tpserve launch`: the whole stack on one machine, as separate OS processes, and running it as a child.

launch() checks the machine, starts the stack (common/stack.py: the replicas and the router, each on a
free port), waits until the router's health is SERVING (logging each phase's time), then watches it: a
child that dies is restarted up to --max-restarts, else takes the stack down with an error naming it (a
replica whose restarts are spent is given up while others serve); SIGINT/SIGTERM stop every child, router
first so clients see the drain before the workers go. running_stack() is `tpserve launch` as a child
process, for tests and the benchmark.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.grpc_util import check_ports_free
from common.launch import LaunchConfig
from common.stack import Interrupted, Stack

log = logging.getLogger("tpserve.launch")


def check_machine(config: LaunchConfig) -> None:
    """What this machine must offer, checked before anything starts (loading a model can take minutes):
    the router's ports free, and with --device cuda a device for each of the --tp ranks (replicas share
    them). ValueError names what is missing."""
    check_ports_free(config.host, dict(config.router_ports))
    if config.device == "cuda":
        import torch  # only here: a CPU launch does not load it

        from shard_worker.devices import check_cuda_devices

        check_cuda_devices(config.tp, torch.cuda.device_count())


def launch(config: LaunchConfig) -> int:
    """Serves until SIGINT/SIGTERM (0), or a child's death (1). A misconfiguration, the launcher's own
    (check_machine) or one a child reports while starting, raises ValueError once every child stopped."""
    check_machine(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(config, stop)
    try:
        try:
            target = stack.start()
        except Interrupted:
            log.info("stopping while starting")
            return 0
        except (RuntimeError, TimeoutError) as e:
            if stop.is_set():
                return 0
            log.error("start-up failed: %s", e)
            return 1
        log.info(
            "tpserve serving on %s (%d replica(s), tensor_parallel_size %d), SERVING %.1fs after launch; "
            "Ctrl-C stops it",
            *(target, config.replicas, config.tp, time.monotonic() - stack.started),
        )
        if config.ready_file:
            _write_ready_file(config.ready_file, stack, target)
        restarts = 0
        while not stop.wait(0.2):
            dead = stack.first_dead()
            if dead is None:
                continue
            what = f"{dead.name} (pid {dead.proc.pid}) exited with code {dead.proc.returncode}"
            if dead.name != "router" and restarts >= config.max_restarts and stack.live_replicas() > 1:
                # Other replicas still serve behind the router: give this one up, keep the launch.
                stack.abandon(dead.replica)
                log.error(
                    "%s: replica %d is down for good, %d left", what, dead.replica, stack.live_replicas()
                )
                if config.ready_file:
                    _write_ready_file(config.ready_file, stack, target)
                continue
            if dead.name == "router" or restarts >= config.max_restarts:
                log.error("%s: stopping", what)
                return 1
            restarts += 1
            log.warning("%s: restarting it (restart %d of %d)", what, restarts, config.max_restarts)
            try:
                stack.restart(dead)
            except Interrupted:
                break
            except (RuntimeError, TimeoutError) as e:
                log.error("restart failed: %s", e)
                return 1
            if config.ready_file:  # the restarted process has a new pid
                _write_ready_file(config.ready_file, stack, target)
        log.info("stopping")
        return 0
    finally:
        stack.stop()
        time.sleep(0)  # let log lines flush in order


def _write_ready_file(path: str, stack: Stack, target: str) -> None:
    """What a test or a tool needs to reach every process: rewritten after each restart (new pids)."""
    replicas = [
        {"scheduler": f"127.0.0.1:{sched.port}", "workers": [f"127.0.0.1:{port}" for port in worker_ports]}
        for sched, worker_ports in zip(stack.scheduler_ports, stack.worker_ports, strict=True)
    ]
    info = {
        "target": target,
        # Replica 0's processes keep the single-replica names ("scheduler", "shard-worker rank 0");
        # replica i's are "scheduler i", "shard-worker i rank 0", ...
        "pids": {c.name: c.proc.pid for c in stack.children},
        "metrics_ports": stack.metrics,
        "http_port": stack.http_port,  # None without --http-port
        # Internal ports, for tests and tools that talk to a process directly: replica 0's, and every
        # replica's under "replicas".
        "scheduler": replicas[0]["scheduler"],
        "workers": replicas[0]["workers"],
        "replicas": replicas,
    }
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


class LaunchFailed(RuntimeError):
    """`tpserve launch` exited, or was not serving in time."""


@contextlib.contextmanager
def running_stack(model, *flags: str, timeout_s: float = 600.0, log_level: str = "WARNING", log_path=None):
    """`tpserve launch` as a child process on a free port, for tests and the benchmark; yields
    (ready info, the launcher's Popen) once it serves and stops it (by its pid) afterwards.

    With log_path, the stack's output goes there and a failure's message ends with its tail."""
    ready = Path(tempfile.gettempdir()) / f"tpserve-ready-{os.getpid()}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "common.cli", "--log-level", log_level, "launch", "--model", str(model)]
    cmd += ["--port", "0", "--ready-file", str(ready), *flags]
    log = open(log_path, "wb") if log_path else None  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)

    def tail() -> str:
        return ":\n" + Path(log_path).read_text(errors="replace")[-3000:] if log_path else ""

    try:
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None:
                raise LaunchFailed(f"tpserve launch exited with {proc.returncode} before serving{tail()}")
            if time.monotonic() > deadline:
                raise LaunchFailed(f"tpserve launch not serving after {timeout_s:.0f}s{tail()}")
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        info["ready_file"] = ready  # rewritten with the new pids whenever a process is restarted
        yield info, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        ready.unlink(missing_ok=True)
        if log:
            log.close()
