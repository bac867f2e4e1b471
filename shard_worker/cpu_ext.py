"""The worker's C++ CPU kernels (attention/csrc/, model/quant/csrc/): each built once per machine, loaded
through ctypes.

A source is plain C++17 with OpenMP and no torch headers, so it builds in seconds with the system's C++
compiler (`$CXX`, else g++ or c++), with -march=native: the CPU it runs on decides its vector width
(AVX2, AVX-512, AVX-512 BF16). A flag set other than "native" builds it for less than this CPU has
(`avx512`: no AVX-512 BF16; `avx2`: no AVX-512; `scalar`: no AVX at all), so that tests prove the paths
this machine would not take.
The library is kept in the worker's compile cache (TORCHINDUCTOR_CACHE_DIR, set from --compile-cache-dir
by shard_worker/startup.py) under a name that hashes the source, the compiler, the flags and the CPU's
feature flags, so a restart loads it and a different node builds its own. Several ranks building at
once each write a private file and rename it into place.

OpenMP: a library links libgomp.so.1, which resolves to the copy torch has already loaded (same soname),
so the kernels and torch's own parallel regions share one thread pool instead of two competing ones.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# What each flag set adds to FLAGS (later -m options win over -march=native's).
VARIANTS = {"native": (), "avx512": ("-mno-avx512bf16",), "avx2": ("-mno-avx512f",), "scalar": ("-mno-avx",)}


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here (no compiler, a failed build); the message says why."""


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cache_root() -> Path:
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.expanduser("~/.cache/tpserve/compile"))


class Extension:
    """One library from a C++ source (and `more`: other sources compiled with it, headers they include):
    `load()` gives it (built first when this machine's cache has none), with `abi_symbol()` checked
    against `abi` so a stale build of another version is refused."""

    def __init__(
        self, name: str, source: Path, abi_symbol: str, abi: int, what: str, more: tuple[Path, ...] = ()
    ):
        self.name, self.source, self.abi_symbol, self.abi, self.what = name, source, abi_symbol, abi, what
        self.more = more
        self._loaded: dict[str, ctypes.CDLL | Exception] = {}
        self._lock = threading.Lock()  # one build at a time: a second caller waits for the first's

    def flags(self, variant: str) -> tuple[str, ...]:
        return FLAGS + VARIANTS[variant]

    def cache_dir(self) -> Path:
        return cache_root() / f"tpserve_{self.name}"

    def library_path(self, cxx: str, variant: str = "native") -> Path:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256()
        flags = " ".join(self.flags(variant))
        sources = b"".join(f.read_bytes() for f in (self.source, *self.more))
        for part in (sources, version.encode(), flags.encode(), _cpu_flags().encode()):
            key.update(part)
        suffix = "" if variant == "native" else f"_{variant}"
        return self.cache_dir() / f"{self.source.stem}{suffix}_{key.hexdigest()[:16]}.so"

    def build(self, cxx: str, target: Path, variant: str = "native") -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            done = subprocess.run(
                [cxx, *self.flags(variant), *self._compiled(), "-o", scratch],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                raise KernelUnavailable(f"{cxx} failed on {self.source.name}: {done.stderr.strip()[-400:]}")
            os.replace(scratch, target)
        finally:
            if os.path.exists(scratch):
                os.unlink(scratch)

    def _compiled(self) -> list[str]:
        return [str(f) for f in (self.source, *self.more) if f.suffix in (".cpp", ".cc")]

    def load(self, variant: str = "native") -> ctypes.CDLL:
        """The library, built first if this machine has none yet. KernelUnavailable when it cannot be
        (remembered: one attempt per process and flag set, until `forget()`)."""
        got = self._loaded.get(variant)
        if got is None:
            with self._lock:
                got = self._loaded.get(variant)
                if got is None:
                    try:
                        got = self._load(variant)
                    except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
                        got = e
                    self._loaded[variant] = got
        if isinstance(got, Exception):
            raise got
        return got

    def _load(self, variant: str) -> ctypes.CDLL:
        cxx = compiler()
        if cxx is None:
            raise KernelUnavailable(f"no C++ compiler ($CXX, g++ or c++) to build {self.what}")
        path = self.library_path(cxx, variant)
        if not path.exists():
            self.build(cxx, path, variant)
        lib = ctypes.CDLL(str(path))
        if getattr(lib, self.abi_symbol)() != self.abi:
            raise KernelUnavailable(f"{path} is another version of {self.what}")
        return lib

    def build_in_background(self) -> None:
        """Start building (or loading) the native library on a thread, so that a cold start compiles it
        beside other work; the first load() waits for it."""
        threading.Thread(target=self.unavailable, name=f"build {self.name}", daemon=True).start()

    def forget(self) -> None:
        """Load again on the next call (tests: a new process, as far as the cache is concerned)."""
        self._loaded.clear()

    def unavailable(self, variant: str = "native") -> str | None:
        """Why the library cannot run here, in one line; None when it can (building it if needed)."""
        try:
            self.load(variant)
        except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
            return str(e).splitlines()[0] if str(e) else type(e).__name__
        return None
