"""Host work per step outside the forward pass: what the step protocol costs the scheduler and a worker.

    python -m bench.step_host [--seqs 32 128] [--context 2048] [--ranks 2] [--steps 50]

Drives the real pieces in one process, with no model and no network: Scheduler.schedule, StepBuilder
(which encodes the plan straight into the StepRequest) and its serialization (once, whatever the number
of ranks), the worker's decoding of it (block tables kept across steps) and the device tensors the
forward starts from (StepBatch.build: positions and KV slots derived there), and Scheduler.update with
the RequestOutputs for the router.
Every sequence decodes at the given context. Prints the median milliseconds of each part per step and the
bytes a step puts on the wire.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from common.pb.tpserve.internal.v1 import scheduler_pb2, worker_pb2
from scheduler.batch import StepBuilder
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence
from shard_worker.attention import StepBatch
from shard_worker.block_tables import BlockTables
from shard_worker.servicer import worker_step

BLOCK_SIZE = 16


def measure(num_seqs: int, context: int, steps: int) -> dict[str, float]:
    max_model_len = context + 4 * steps + 16
    num_blocks = num_seqs * (max_model_len // BLOCK_SIZE + 2)
    blocks = BlockManager(num_blocks, BLOCK_SIZE)
    policy = SchedulingPolicy(
        max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs), max_model_len=max_model_len
    )
    sched = Scheduler(policy, blocks)
    for i in range(num_seqs):
        sched.add(Sequence(i, f"r{i}", [5] * context, context, max_model_len - context))
    builder, tables = StepBuilder(), BlockTables(-(-max_model_len // BLOCK_SIZE), num_blocks, BLOCK_SIZE)
    rows_of: dict[int, int] = {}

    def step() -> tuple[list[float], int]:
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        data = builder.build(out).SerializeToString()
        t2 = time.perf_counter()
        step = worker_step(worker_pb2.StepRequest.FromString(data))
        # A row per sequence, taken the first time it appears (shard_worker/worker.py WorkerSequence.row).
        for i in step.seq_ids:
            if i not in rows_of:
                rows_of[i] = tables.take_row()
        rows = np.array([rows_of[i] for i in step.seq_ids])
        table = tables.apply(
            step.seq_ids, rows, step.table_reset, step.new_block_counts, step.new_block_ids, step.context_lens
        )
        # What ModelRunner.execute makes of it before the forward (the backend's own metadata aside).
        StepBatch.build(
            step.input_ids, step.query_lens, step.context_lens, table, BLOCK_SIZE, torch.device("cpu")
        )
        t3 = time.perf_counter()
        updates = sched.update(out, [[7]] * len(out.sampled))
        outputs = [
            scheduler_pb2.RequestOutput(request_id=u.seq.request_id, token_ids=u.new_tokens) for u in updates
        ]
        scheduler_pb2.SchedulerMessage(outputs=outputs).SerializeToString()
        t4 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3], len(data)

    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        step()  # prefill, not measured
    samples = [step() for _ in range(steps)]
    parts = ("schedule", "build+serialize", "worker decode", "update+outputs")
    result = {p: statistics.median(s[0][i] for s in samples) * 1e3 for i, p in enumerate(parts)}
    result["total"] = sum(result[p] for p in parts)
    result["step bytes"] = statistics.median(s[1] for s in samples)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[32, 128])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    for n in a.seqs:
        r = measure(n, a.context, a.steps)
        cells = "  ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "step bytes")
        print(f"{n:4d} seqs at context {a.context}: {cells} ms; {r['step bytes']:.0f} bytes per step")


if __name__ == "__main__":
    main()
