"""A worker's start-up: its phases and their times, and the on-disk cache of what it compiles.

A CPU worker compiles flex attention's kernels (torch.compile, inductor: C++) when it warms up. Inductor's
FX graph cache and AOT autograd's cache keep the generated code on disk, so a restarted worker (a new
replica, or the rank the launcher restarts after a lost process) loads the kernels instead of building
them again. The cache directory is a flag (--compile-cache-dir), applied once in the worker's main()
before anything compiles: inductor reads it from TORCHINDUCTOR_CACHE_DIR each time it needs it, so the
process environment is the one place to put it.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("tpserve.shard_worker")

# What an operator expects: a per-user cache that survives reboots (vLLM keeps its compile cache under
# ~/.cache/vllm), not inductor's default under /tmp.
DEFAULT_COMPILE_CACHE_DIR = "~/.cache/tpserve/compile"


def configure_compile_cache(directory: str) -> Path | None:
    """Points inductor's caches at directory (created if missing); "" turns the on-disk caches off, so
    every start compiles. Returns the directory used, or None."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if not directory:
        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
        return None
    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home, say: serving without the cache beats not serving
        log.warning("--compile-cache-dir %s: %s; compiling without an on-disk cache", directory, e)
        return configure_compile_cache("")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return path


def compile_counts() -> tuple[int, int]:
    """(graphs compiled, graphs loaded from the on-disk cache) by inductor in this process so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    cached = int(inductor["fxgraph_cache_hit"])
    # Misses and bypasses are compiles; with the cache off neither is counted, so dynamo's graphs count.
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
        seconds = time.perf_counter() - start
        self.seconds[name] = seconds
        note = detail()
        note = f" ({note})" if note else ""
        log.info("rank %d: start-up phase %s took %.2fs%s", self.rank, name, seconds, note)

    def compile_note(self) -> str:
        compiled, cached = compile_counts()
        where = self.cache_dir or "off: --compile-cache-dir ''"
        return f"{compiled} graph(s) compiled, {cached} loaded from the compile cache ({where})"
