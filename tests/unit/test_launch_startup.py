"""How `tpserve launch` learns that a child failed while starting: at once, whichever child it waits on,
and in the child's own words. The children are small Python processes, not tpserve."""

import subprocess
import sys
from pathlib import Path

import pytest

from common.launch import LaunchConfig
from common.stack import Child, Stack
from tests.conftest import ROOT

SLEEPER = "import time; time.sleep(120)"  # a rank blocked on its process group, waiting for the others


@pytest.fixture
def stack(tiny_model):
    stack = Stack(LaunchConfig(model=str(tiny_model), startup_timeout_s=30.0))
    yield stack
    stack.stop(grace_s=0.0)


def start(stack: Stack, name: str, code: str) -> Child:
    port_file = stack.tmp / f"{name}.port"
    child = Child(name, subprocess.Popen([sys.executable, "-c", code], cwd=ROOT), [], port_file)
    stack.children.append(child)
    return child


def writes_error_and_exits(port_file: Path, message: str) -> str:
    return (
        f"from common.grpc_util import write_port_error; write_port_error({str(port_file)!r}, {message!r}); "
        "raise SystemExit(2)"
    )


def test_a_rank_that_fails_ends_the_wait_on_another_with_its_message(stack):
    waiting = start(stack, "shard-worker rank 0", SLEEPER)
    start(stack, "shard-worker rank 1", writes_error_and_exits(stack.tmp / "shard-worker rank 1.port", "bad"))
    with pytest.raises(ValueError, match="^shard-worker rank 1: bad$"):
        stack._port_of(waiting)  # within the 30 s timeout only because rank 1's death is noticed
    assert waiting.alive


def test_a_child_that_dies_without_a_word_is_named_with_its_exit_code(stack):
    waiting = start(stack, "shard-worker rank 0", SLEEPER)
    start(stack, "shard-worker rank 1", "raise SystemExit(3)")
    with pytest.raises(RuntimeError, match="^shard-worker rank 1 exited with code 3 while starting$"):
        stack._port_of(waiting)


def test_a_restart_waits_only_on_what_it_restarts(stack):
    """The scheduler dying while the worker group restarts (both lost at once) does not fail the
    worker's restart: the launcher's loop restarts the scheduler next."""
    port_file = stack.tmp / "shard-worker rank 0.port"
    writes_port = (
        f"import json, time; time.sleep(0.5); open({str(port_file)!r}, 'w')"
        ".write(json.dumps({'port': 1234})); time.sleep(120)"
    )
    worker = start(stack, "shard-worker rank 0", writes_port)
    start(stack, "scheduler", "raise SystemExit(-9)")
    assert stack._port_of(worker, [worker]) == 1234
    with pytest.raises(RuntimeError, match="^scheduler exited"):
        stack._port_of(start(stack, "shard-worker rank 1", SLEEPER))  # a start watches every child
