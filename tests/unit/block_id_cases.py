"""Cases for tests/unit/test_block_ids.py: block ids outside the KV cache and block tables shorter than their
context, given to the worker, to every backend through the model runner, and to the C++ kernel directly.

Run as `TRITON_INTERPRET=1 python tests/unit/block_id_cases.py` (in a process of its own: a check that
failed here would read outside the cache, which can segfault). Prints one JSON line per case, {"case",
"error"}: the message of the ValueError it raised, or null when it raised none.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from scheduler.batch import StepBuilder  # noqa: E402
from scheduler.block_manager import BlockManager  # noqa: E402
from scheduler.scheduler import Scheduler, SchedulingPolicy  # noqa: E402
from scheduler.sequence import Sequence  # noqa: E402
from shard_worker.attention import Attention, StepBatch, cpu_kernel, select_backend  # noqa: E402
from shard_worker.model_runner import ModelRunner  # noqa: E402
from shard_worker.parallel import TensorParallel  # noqa: E402
from shard_worker.servicer import worker_step  # noqa: E402
from shard_worker.step import StepInputs  # noqa: E402
from shard_worker.worker import Worker  # noqa: E402

TINY = ROOT / "models" / "tiny"
CPU = torch.device("cpu")
BS = 4
NUM_BLOCKS = 16


def scheduled_step():
    """A real first step for two sequences: 9 prompt tokens (3 blocks) and 5 (2 blocks)."""
    sched = Scheduler(SchedulingPolicy(max_model_len=64), BlockManager(NUM_BLOCKS, BS), [1])
    sched.add(Sequence(1, "r1", list(range(5, 14)), 9, 2, ignore_eos=True))
    sched.add(Sequence(2, "r2", [7, 8, 9, 10, 11], 5, 2, ignore_eos=True))
    step = worker_step(StepBuilder().build(sched.schedule()))
    # Views of the message's bytes: copies, to change them.
    step.new_block_ids, step.new_block_counts = step.new_block_ids.copy(), step.new_block_counts.copy()
    return step


def worker_cases(runner: ModelRunner) -> dict:
    worker = Worker(runner)
    worker.init_cache(NUM_BLOCKS, BS, 0, 64)
    cases = {}
    bad = scheduled_step()
    bad.new_block_ids[-1] = 99
    cases["worker: id past the pool"] = lambda: worker.step(bad)
    negative = scheduled_step()
    negative.new_block_ids[0] = -1
    cases["worker: negative id"] = lambda: worker.step(negative)
    short = scheduled_step()  # sequence 1 told of 2 of its 3 blocks
    short.new_block_counts[0] -= 1
    short.new_block_ids = np.delete(short.new_block_ids, 2)
    cases["worker: short row"] = lambda: worker.step(short)
    cases["worker: a good step after them"] = lambda: worker.step(scheduled_step())
    return cases


def runner_case(runner: ModelRunner) -> None:
    """A table the worker did not check (a direct caller): refused before the backend reads it."""
    runner.allocate_kv_cache(NUM_BLOCKS, BS)
    inputs = StepInputs(
        seq_ids=[1, 2],
        query_lens=[1, 1],
        context_lens=[6, 3],
        sample_counts=[0, 0],
        input_ids=[5, 6],
        block_table=[[3, 4], [NUM_BLOCKS + 3, 0]],
    )
    runner.execute(inputs)


def kernel_step(table: list[list[int]], positions: list[int], threads: int = 1):
    """The C++ kernel called directly (no host check before it) over a cache of 3 blocks of 16."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 3, 16, 2, 64, generator=gen)
    n = len(positions)
    q = torch.randn(n, 4, 64, generator=gen)
    rows = torch.arange(n, dtype=torch.int64)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernel.paged_attention(
            q,
            torch.empty_like(q),
            cache,
            rows,
            rows,
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(table, dtype=torch.int32),
            0.125,
        )
    finally:
        torch.set_num_threads(previous)


def layer_call_step():
    """The per-layer call (cpu.py's plan): a valid slot for the new token, a bad id in the row before."""
    backend = select_backend("cpu", CPU, torch.float32)
    # Each token at position 5, written to its block 1 (a good id); sequence 1's block 0 is bad. Built
    # without num_blocks: no host check.
    table = np.array([[2, 1], [NUM_BLOCKS + 5, 3]])
    batch = StepBatch.build(np.array([5, 6]), np.array([1, 1]), np.array([6, 6]), table, BS, CPU)
    layer = Attention(4, 2, 64, 0.125)
    cache = torch.zeros(2, NUM_BLOCKS, BS, 2, 64)
    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    backend.forward(layer, q, k, v, cache, backend.context(batch))


def run(name: str, fn) -> None:
    try:
        fn()
        error = None
    except ValueError as e:
        error = str(e)
    print(json.dumps({"case": name, "error": error}), flush=True)


def main() -> None:
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    cpu_runner = ModelRunner(TINY, torch.float32, CPU, TensorParallel(), "auto", "cpu")
    for name, fn in worker_cases(cpu_runner).items():
        run(name, fn)
    for backend in ("cpu", "flex", "reference", "triton"):
        runner = ModelRunner(TINY, torch.float32, CPU, TensorParallel(), "auto", backend)
        run(f"runner {backend}", lambda runner=runner: runner_case(runner))
    run("kernel: id past the pool", lambda: kernel_step([[1, 7]], [20]))
    run("kernel: negative id", lambda: kernel_step([[-2]], [3]))
    run("kernel: position past the table", lambda: kernel_step([[0, 1]], [40]))
    run("kernel: sequence past the table", lambda: kernel_step([[0]], [3, 3]))
    # Long contexts on two threads: the check inside the parallel region.
    long_rows = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1]] * 4
    long_rows[2] = [*long_rows[2][:17], 9, 1, 2]
    run("kernel: id past the pool, threads", lambda: kernel_step(long_rows, [310] * 4, threads=2))
    run("kernel: good, threads", lambda: kernel_step([r[:] for r in long_rows[:2]], [310, 300], threads=2))
    run("layer call: id past the pool", layer_call_step)


if __name__ == "__main__":
    main()
