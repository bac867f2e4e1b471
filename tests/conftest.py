"""Fixtures that start real tpserve processes: free ports, wait on health, stop what they started."""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from common.launcher import running_stack

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "tiny"
SMOLLM2 = ROOT / "models" / "smollm2"


# The modules that serve the session's SmolLM2 stack (smollm2_stack below). Under `-n N --dist loadfile` they
# are one unit of work, so one worker starts that stack once (each start costs 40-50 s, and the stack then
# holds its memory to the session's end); a module missing from this list still works, on a stack of its
# worker's own.
SMOLLM2_MODULES = {
    "tests/e2e/test_agent_apis_serving.py",
    "tests/e2e/test_chat.py",
    "tests/e2e/test_openai.py",
    "tests/e2e/test_openai_vllm.py",
    "tests/e2e/test_pooling_serving.py",
    "tests/e2e/test_structured.py",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the SmolLM2 modules as one unit, and the units handed out in collection
    order (tests/e2e/ first: its modules are the long ones) rather than xdist's default of most tests
    first, which left the e2e modules, a few long tests each, to run last and set the tail."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "smollm2 stack" if module in SMOLLM2_MODULES else module

    config.option.loadscopereorder = False
    return Scheduling(config, log)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not (TINY / "config.json").is_file():
        from shard_worker.model.builder import build_model

        build_model("tiny", TINY)
    return TINY


@pytest.fixture(scope="session")
def reference(tiny_model) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy continuations of the reference prompts (tests/reference.py), computed once."""
    from tests.reference import hf_greedy

    return hf_greedy(tiny_model)


@pytest.fixture
def one_thread():
    """Runs the test on one intra-op thread. With two on a 2-core machine that anything else is also using,
    OpenMP's threads wait on each other: transformers' generate measured 10 to 20 times slower (20 s against
    2 s for 32 tokens). Both sides of each comparison run under the same setting; the CPU kernels' tests
    show separately that several threads change no bit."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def held_port():
    """A port another socket listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, str]:
    """A throwaway CA, certificates it signed and an untrusted CA's (tests/pki.py), made once."""
    from tests.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.contextmanager
def launch(model: Path, *flags: str, startup_timeout: float = 180.0, log_level: str = "WARNING"):
    """Runs `tpserve launch` on a free port; yields (router target, ready info). Stops it by pid.

    Test stacks run --dtype float32 unless the flags name a dtype: the tests compare with transformers'
    float32, and launch's own default (auto) is bfloat16 on CPUs that multiply it natively.
    info["launcher"] is its Popen; info["log"] the path of the stack's combined output (removed after)."""
    if "--dtype" not in flags:
        flags = ("--dtype", "float32", *flags)
    tmp = Path(os.environ.get("PYTEST_TMPDIR", "/tmp"))
    log_path = tmp / f"tpserve-{os.getpid()}-{time.monotonic_ns()}.log"
    try:
        with running_stack(
            model, *flags, timeout_s=startup_timeout, log_level=log_level, log_path=log_path
        ) as (info, proc):
            info["launcher"] = proc
            info["log"] = log_path
            yield info["target"], info
    finally:
        log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def smollm2_stack():
    """One SmolLM2 stack for every module that serves it (each start costs 40-50 s): (gRPC target, ready
    info with the HTTP port). float32 (the chat tests compare with transformers' float32), hermes tool
    calls."""
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("models/smollm2 is not built (`make model-smollm2`; `make test` does it first)")
    flags = ("--http-port", "0", "--dtype", "float32")
    flags += ("--tool-call-parser", "hermes")
    with launch(SMOLLM2, *flags, startup_timeout=600) as (target, info):
        yield target, info


def post_json(info: dict, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    """A bare POST to a stack's HTTP port, as curl sends it: (status, JSON body), errors included."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{info['http_port']}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
