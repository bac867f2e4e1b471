"""A block id outside the KV cache, or a block table shorter than its context, is an error naming the
sequence (or the batch row) and the id, in every attention backend: never a read outside the cache (a
segfault) and never another sequence's keys and values (block 0 for the positions a short row lacks).
Checked on the host where a table row is written (shard_worker/block_tables.py, naming the sequence), where
a step's batch is built (StepBatch.build, for every backend), and by the C++ kernel itself (its reads).

The cases run in one process of their own (tests/unit/block_id_cases.py): a check that failed there could
segfault."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def errors(tiny_model) -> dict[str, str | None]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "unit" / "block_id_cases.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])  # -11 would be a segfault
    return {case["case"]: case["error"] for case in map(json.loads, run.stdout.splitlines())}


def test_the_worker_refuses_an_id_outside_the_pool_naming_the_sequence(errors):
    assert errors["worker: id past the pool"] == "sequence 2: block id 99 is outside the KV cache's 16 blocks"
    assert errors["worker: negative id"] == "sequence 1: block id -1 is outside the KV cache's 16 blocks"


def test_the_worker_refuses_a_table_shorter_than_its_context(errors):
    want = "sequence 1: a context of 9 tokens needs 3 blocks, its table holds 2"
    assert errors["worker: short row"] == want
    assert errors["worker: a good step after them"] is None  # a refused step changed nothing


@pytest.mark.parametrize("backend", ["cpu", "flex", "reference", "triton"])
def test_every_backend_is_given_only_ids_of_the_cache(errors, backend):
    want = "batch row 1: block id 19 (its block 0) is outside the KV cache's 16 blocks"
    assert errors[f"runner {backend}"] == want


def test_the_cpu_kernel_refuses_what_it_would_read_outside_the_cache_or_the_table(errors):
    assert errors["kernel: id past the pool"] == (
        "batch row 0: block id 7 (its block 1) is outside the KV cache's 3 blocks"
    )
    assert errors["kernel: negative id"] == (
        "batch row 0: block id -2 (its block 0) is outside the KV cache's 3 blocks"
    )
    assert errors["kernel: position past the table"] == (
        "batch row 0: a position needs its block 2, the block table holds 2"
    )
    assert errors["kernel: sequence past the table"] == "batch row 1 is not in the block table's 1 rows"
    # Met by one thread of two inside the parallel region; the same call with good ids passes.
    assert errors["kernel: id past the pool, threads"] == (
        "batch row 2: block id 9 (its block 17) is outside the KV cache's 3 blocks"
    )
    assert errors["kernel: good, threads"] is None
    assert errors["layer call: id past the pool"] == (
        "batch row 1: block id 21 (its block 0) is outside the KV cache's 16 blocks"
    )
