"""A worker's start-up: its phases and their times, and the on-disk cache of what it compiles.

A CPU worker compiles flex attention's kernels (torch.compile, inductor: C++) when it warms up. Inductor's
FX graph cache and AOT autograd's cache keep the generated code on disk, so a restarted worker (a new
replica, or the rank the launcher restarts after a lost process) loads the kernels instead of building
them again. The cache directory is a flag (--compile-cache-dir), applied once in the worker's main()
before anything compiles: inductor reads it from TORCHINDUCTOR_CACHE_DIR each time it needs it, so the
process environment is the one place to put it.

Inductor also probes, in each process, which vector instruction sets it may compile for: it builds a
test library per candidate (kept in the cache) and loads each in a child Python, six of them on this
AMD EPYC (0.6 s of a start on a quiet 2-core machine, 2.7 s on a loaded one). Whether they load depends
on the CPU, the compiler and torch: once every load passed, that is noted beside the kernels
(VEC_ISA_FILE), and a later start on the same three takes the loads as passed (the libraries are still
built, or found built, so the instruction sets chosen are the same). Not through inductor's own switch
(TORCHINDUCTOR_VEC_ISA_OK): it is part of the kernels' cache key, and skips only some of the probes.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
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


VEC_ISA_FILE = "tpserve-vec-isa.json"


def _machine() -> dict:
    """What inductor's instruction set probe depends on: the CPU's flags, the C++ compiler, torch."""
    import torch

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    compiler = shutil.which(os.environ.get("CXX", "c++")) or ""
    return {
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest(),
        "compiler": os.path.realpath(compiler) if compiler else "",
        "torch": torch.__version__,
    }


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# This process's instruction set probes (install_vec_isa_probe): whether their loads are known to pass,
# and how many ran and failed. Process-wide, as inductor's probe is.
_probe = {"installed": False, "known": False, "ran": 0, "failed": 0}


def install_vec_isa_probe() -> None:
    """Before the first compile, in any thread: wraps inductor's load probe, which then passes at once
    when this machine's loads are known to pass (VEC_ISA_FILE in the compile cache), and otherwise
    counts what it answers. Once per process."""
    if _probe["installed"]:
        return
    from torch._inductor import cpu_vec_isa

    _probe["installed"] = True
    load = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if load is None:  # another torch: its probe as it is
        return
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    _probe["known"] = bool(cache) and _read_json(Path(cache) / VEC_ISA_FILE) == _machine()

    def probe_load(isa, output_path: str) -> bool:
        if _probe["known"]:
            return True
        passed = load(isa, output_path)
        _probe["ran"] += 1
        _probe["failed"] += not passed
        return passed

    cpu_vec_isa.VecISA._probe_load = probe_load


def remember_vec_isa(cache_dir: Path | None) -> None:
    """After the kernels were built: notes in cache_dir that this machine's loads pass, when every one
    this process probed passed."""
    if cache_dir is None or _probe["known"] or not _probe["ran"] or _probe["failed"]:
        return
    with contextlib.suppress(OSError):  # a read-only cache: it probes again next time
        tmp = cache_dir / f"{VEC_ISA_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(_machine()))
        os.replace(tmp, cache_dir / VEC_ISA_FILE)


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
