"""Fixtures that start real tpserve processes: free ports, wait on health, stop what they started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "tiny"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not (TINY / "config.json").is_file():
        from common.model_builder import build_model

        build_model("tiny", TINY)
    return TINY


@contextlib.contextmanager
def launch(model: Path, *flags: str, startup_timeout: float = 180.0, log_level: str = "WARNING"):
    """Runs `tpserve launch` on a free port; yields (router target, ready info). Stops it by pid.

    info["log"] is the path of the stack's combined stdout and stderr (removed afterwards)."""
    tmp = Path(os.environ.get("PYTEST_TMPDIR", "/tmp"))
    ready = tmp / f"tpserve-ready-{os.getpid()}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "common.cli", "--log-level", log_level, "launch", "--model", str(model)]
    cmd += ["--port", "0", "--ready-file", str(ready), *flags]
    log_path = ready.with_suffix(".log")
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + startup_timeout
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"tpserve launch exited with {proc.returncode} before serving:\n{log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"tpserve launch not ready after {startup_timeout}s:\n{log_tail()}")
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        info["launcher"] = proc
        info["log"] = log_path
        yield info["target"], info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        ready.unlink(missing_ok=True)
        log.close()
        log_path.unlink(missing_ok=True)
