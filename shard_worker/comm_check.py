"""`tpserve check-comm`: is this node's interconnect fit to serve tensor-parallel? An all-reduce sweep over
the ranks of a group, the way the shard workers will use it (NCCL on CUDA, gloo on CPU).

    tpserve check-comm --world-size N [--device cpu|cuda]            # every rank on this machine
    tpserve check-comm --world-size N --rank R --dist-init HOST:PORT # one rank (a pod of a Job)

Message sizes run from one sequence's activations (hidden_size elements) doubling to 64 MiB, through a
decode step's (max_num_seqs x hidden_size). Per size, every rank times `iters` all-reduces after a warm-up
and the slowest rank's mean is reported, with bandwidths as nccl-tests defines them for all-reduce:
algbw = bytes / time, busbw = algbw * 2 (n - 1) / n (what each link carries, comparable across n).

Verdict, against the reference's operating limits: the all-reduces of one decode step (two per layer, each
of the step's activations) take under step_limit_ms (5 ms), and the links carry over link_limit_gbit
(200 Gbit/s) of bus bandwidth at the largest size. The exit status is 0 only when both hold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

# torch is imported inside the functions that run the sweep: every `tpserve` command builds this module's
# flags, and only check-comm needs torch.

MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Sample:
    bytes: int
    seconds: float  # the slowest rank's mean time per all-reduce
    algbw_gbps: float  # GB/s (1e9 bytes)
    busbw_gbps: float


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: each rank sends and receives 2 (n - 1) / n of the data."""
    return algbw * 2 * (world_size - 1) / world_size


def sizes(hidden_size: int, max_num_seqs: int, itemsize: int, max_bytes: int = MAX_BYTES) -> list[int]:
    """One sequence's activations doubling up to max_bytes, with a decode step's size included."""
    out, n = set(), hidden_size * itemsize
    while n <= max_bytes:
        out.add(n)
        n *= 2
    out.add(min(max_num_seqs * hidden_size * itemsize, max_bytes))
    return sorted(out)


def sweep(rank: int, world_size: int, dist_init: str, device: str, dtype_name: str, byte_sizes, iters: int):
    """This rank's part of the sweep; rank 0 gets the samples, the others None."""
    import torch
    import torch.distributed as dist

    from shard_worker.parallel import init_tensor_parallel

    dtype = getattr(torch, dtype_name)
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    tp = init_tensor_parallel(rank, world_size, dist_init, dev)
    samples = []
    try:
        for nbytes in byte_sizes:
            x = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype, device=dev)
            for _ in range(3):  # warm-up: connections, buffers
                dist.all_reduce(x, group=tp.group)
            _sync(dev)
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x, group=tp.group)
            _sync(dev)
            mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=dev)
            dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=tp.group)
            seconds = float(mean.item())
            algbw = nbytes / seconds / 1e9
            samples.append(Sample(nbytes, seconds, algbw, bus_bandwidth(algbw, world_size)))
    finally:
        dist.destroy_process_group()
    return samples if rank == 0 else None


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass(frozen=True)
class Verdict:
    step_allreduce_ms: float  # two all-reduces per layer of the decode step's activations
    link_gbit: float  # bus bandwidth at the largest size, in Gbit/s
    step_ok: bool
    link_ok: bool


def verdict(
    samples: list[Sample], step_bytes: int, num_layers: int, step_limit_ms: float, link_limit_gbit: float
):
    step = min(samples, key=lambda s: abs(s.bytes - step_bytes))
    step_ms = 2 * num_layers * step.seconds * 1e3
    link = samples[-1].busbw_gbps * 8
    return Verdict(step_ms, link, step_ms < step_limit_ms, link > link_limit_gbit)


def report(samples: list[Sample], v: Verdict, a: argparse.Namespace) -> str:
    lines = [
        f"all-reduce over {a.world_size} rank(s), {a.device}, {a.dtype}",
        "",
        "       bytes      time us   algbw GB/s   busbw GB/s",
    ]
    for s in samples:
        lines.append(
            f"{s.bytes:>12,}  {s.seconds * 1e6:>11.1f}  {s.algbw_gbps:>11.2f}  {s.busbw_gbps:>11.2f}"
        )
    lines.append("")
    shape = f"{a.max_num_seqs} seqs x hidden {a.hidden_size}, {a.num_layers} layers, 2 all-reduces each"
    lines.append(
        f"one decode step ({shape}): {v.step_allreduce_ms:.2f} ms (limit {a.step_limit_ms} ms): "
        f"{'PASS' if v.step_ok else 'FAIL'}"
    )
    lines.append(
        f"bus bandwidth at {samples[-1].bytes / 2**20:.0f} MiB: {v.link_gbit:.1f} Gbit/s "
        f"(limit {a.link_limit_gbit} Gbit/s): {'PASS' if v.link_ok else 'FAIL'}"
    )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, required=True, help="ranks in the group")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL; cpu: gloo")
    p.add_argument(
        "--rank", type=int, default=None, help="run only this rank (with --dist-init); default: all"
    )
    p.add_argument(
        "--dist-init", default=None, help="HOST:PORT of rank 0's store (default: a free local port)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--hidden-size", type=int, default=4096, help="the model's (Llama-3-8B: 4096)")
    p.add_argument("--num-layers", type=int, default=32, help="the model's (Llama-3-8B: 32)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences in a decode step")
    p.add_argument("--iters", type=int, default=20, help="timed all-reduces per size")
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="the largest message")
    p.add_argument("--step-limit-ms", type=float, default=5.0, help="one decode step's all-reduces")
    p.add_argument("--link-limit-gbit", type=float, default=200.0, help="bus bandwidth at the largest size")
    p.add_argument("--out", default=None, help="write the samples and the verdict as JSON here")


def _rank_main(rank: int, a: argparse.Namespace, byte_sizes: list[int], queue) -> None:
    samples = sweep(rank, a.world_size, a.dist_init, a.device, a.dtype, byte_sizes, a.iters)
    if queue is not None and samples is not None:
        queue.put([asdict(s) for s in samples])


def main(a: argparse.Namespace) -> int:
    import torch

    if a.world_size < 2:
        print(
            "tpserve check-comm: --world-size must be at least 2 (one rank has nothing to reduce)",
            file=sys.stderr,
        )
        return 2
    if a.device == "cuda" and a.rank is None and torch.cuda.device_count() < a.world_size:
        print(
            f"tpserve check-comm: --world-size {a.world_size} needs as many GPUs here, "
            f"{torch.cuda.device_count()} are visible",
            file=sys.stderr,
        )
        return 2
    itemsize = getattr(torch, a.dtype).itemsize
    byte_sizes = sizes(a.hidden_size, a.max_num_seqs, itemsize, a.max_bytes)
    if a.rank is not None:  # one rank of a group spread over pods
        if not a.dist_init:
            print("tpserve check-comm: --rank needs --dist-init HOST:PORT", file=sys.stderr)
            return 2
        samples = sweep(
            a.rank, a.world_size, a.dist_init, a.device, getattr(torch, a.dtype), byte_sizes, a.iters
        )
        if samples is None:
            return 0
    else:
        import torch.multiprocessing as mp

        from common.grpc_util import ReservedPort

        rendezvous = ReservedPort()  # held until the process exits
        a.dist_init = a.dist_init or f"127.0.0.1:{rendezvous.port}"
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_rank_main, args=(r, a, byte_sizes, queue if r == 0 else None))
            for r in range(a.world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            print(
                f"tpserve check-comm: a rank failed (exit codes {[p.exitcode for p in procs]})",
                file=sys.stderr,
            )
            return 1
        samples = [Sample(**s) for s in queue.get(timeout=5)]
    step_bytes = a.max_num_seqs * a.hidden_size * itemsize
    v = verdict(samples, step_bytes, a.num_layers, a.step_limit_ms, a.link_limit_gbit)
    print(report(samples, v, a))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "samples": [asdict(s) for s in samples],
                    "verdict": asdict(v),
                    "world_size": a.world_size,
                    "device": a.device,
                    "dtype": a.dtype,
                    "pid": os.getpid(),
                },
                f,
                indent=2,
            )
    return 0 if v.step_ok and v.link_ok else 1
