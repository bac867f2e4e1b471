"""Two ranks in real processes over torch.distributed (gloo, CPU), for tests that compare what a model runner
gives split across ranks with what it gives whole. One pair of processes runs every case of a module
(spawning and importing torch is the slow part)."""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.grpc_util import ReservedPort
from shard_worker.parallel import init_tensor_parallel

JOIN_TIMEOUT_S = 180
FAILED = "rank failed"

# work(tp, *args) runs on each rank and yields (key, value) pairs; rank 0's are the results.
Work = Callable[..., Iterator[tuple[Any, Any]]]


def _rank_main(rank: int, addr: str, work: Work, args: tuple, results, release) -> None:
    try:
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        tp = init_tensor_parallel(rank, 2, addr, torch.device("cpu"))
        for key, value in work(tp, *args):
            if rank == 0:
                results.put((key, value))
        # Neither rank may tear its connections down while the other still uses them, and rank 0, which
        # serves the rendezvous store, leaves last. The group must be destroyed by its last owner: one
        # still referenced (by tp, or a runner the work kept) is destroyed at interpreter exit instead,
        # where gloo's threads abort the process now and then ("terminate called without an active
        # exception"). The work's generator is exhausted here, so its runners are gone with it.
        dist.barrier()
        del tp
        gc.collect()
        dist.destroy_process_group()
        if rank == 0:
            release.wait(JOIN_TIMEOUT_S)
    except BaseException:
        results.put((FAILED, f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def run_two_ranks(work: Work, args: tuple, count: int) -> dict:
    """Runs work(tp, *args) on two spawned ranks (work must be a module-level function: it is pickled) and
    returns rank 0's `count` results by key. A rank's exception fails the test with its traceback."""
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    rendezvous = ReservedPort()  # held until the ranks are done (closed below)
    addr = f"127.0.0.1:{rendezvous.port}"
    procs = [ctx.Process(target=_rank_main, args=(r, addr, work, args, results, release)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < count:
            key, value = results.get(timeout=JOIN_TIMEOUT_S)
            if key == FAILED:
                pytest.fail(value)
            got[key] = value
        for rank in (1, 0):
            procs[rank].join(timeout=JOIN_TIMEOUT_S)
            release.set()
            assert procs[rank].exitcode == 0, f"rank {rank} exited with {procs[rank].exitcode}"
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        rendezvous.close()
