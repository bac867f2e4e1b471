"""A worker's start-up: its phases and their times, and the on-disk cache of what it compiles.

A CPU worker compiles flex attention's kernels (torch.compile, inductor: C++) when it warms up. Inductor's
FX graph cache and AOT autograd's cache keep the generated code on disk, so a restarted worker (a new
replica, or the rank the launcher restarts after a lost process) loads the kernels instead of building
them again. The cache directory is a flag (--compile-cache-dir), applied once in the worker's main()
before anything compiles: inductor reads it from TORCHINDUCTOR_CACHE_DIR each time it needs it, so the
process environment is the one place to put it.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("tpserve.shard_worker")

# What an operator expects: a per-user cache that survives reboots (vLLM keeps its compile cache under
# ~/.cache/vllm), not inductor's default under /tmp.
DEFAULT_COMPILE_CACHE_DIR = "~/.cache/tpserve/compile"


def configure_compile_cache(directory: str) -> Path | None:
    """Points inductor's caches (FX graph and AOT autograd, both on by default) at directory, created if
    missing; "" gives this process a fresh temporary directory instead, so nothing is reused across
    starts. Returns the directory used, or None for "". Through the environment, not torch's config
    attributes: in torch 2.13 those are context variables, set for the calling thread only, and the
    worker compiles in a gRPC thread."""
    if directory:
        path = Path(directory).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only home, say: serving without the cache beats not serving
            log.warning("--compile-cache-dir %s: %s; compiling without an on-disk cache", directory, e)
            return configure_compile_cache("")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
        return path
    scratch = tempfile.mkdtemp(prefix="tpserve-compile-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch
    return None


def compile_counts() -> tuple[int, int]:
    """(graphs compiled, graphs loaded from the on-disk cache) by inductor in this process so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    cached = int(inductor["fxgraph_cache_hit"])
    # Misses and bypasses (graphs inductor cannot cache) are compiles; dynamo's graph count bounds them.
    missed = int(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"])
    return max(missed, int(counters["stats"]["unique_graphs"]) - cached), cached


class StartupPhases:
    """The phases of this rank's start-up, in order, each logged with its time as it ends."""

    def __init__(self, rank: int, cache_dir: Path | None = None):
        """cache_dir: the compile cache in use (None: off), for the log."""
        self.rank, self.cache_dir = rank, cache_dir
        # name -> seconds, in the order phases first ran (a scheduler that reconnects sizes and warms
        # again: the new times replace the old).
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, detail=lambda: ""):
        """Times the block as phase `name`; detail() adds a note to its log line once it has run."""
        start = time.perf_counter()
        yield
        self.record(name, time.perf_counter() - start, detail())

    def record(self, name: str, seconds: float, note: str = "") -> None:
        """Phase `name` took seconds (timed elsewhere: on another thread, beside another phase)."""
        self.seconds[name] = seconds
        note = f" ({note})" if note else ""
        log.info("rank %d: start-up phase %s took %.2fs%s", self.rank, name, seconds, note)

    def compile_note(self) -> str:
        compiled, cached = compile_counts()
        where = self.cache_dir or "off: --compile-cache-dir ''"
        return f"{compiled} graph(s) compiled, {cached} loaded from the compile cache ({where})"
