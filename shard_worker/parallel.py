"""The tensor-parallel group one shard worker belongs to, passed explicitly to the layers that talk.

Only two collectives exist in the forward pass: the sum all-reduce after row-parallel layers (and the
vocab-parallel embedding), and the gather of LM-head logit shards onto rank 0, which samples; with a
draft model, a third sends the proposals rank 0 drew to the other ranks. All are timed here so the
runner can report how much of a step was communication.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Long enough for the slowest rank to load a large checkpoint before the first collective.
INIT_TIMEOUT = timedelta(minutes=10)


@dataclass
class TensorParallel:
    """This rank's place in the group. group None means no torch.distributed (world_size 1, or a test
    that computes each rank's partial result by hand and must not communicate)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    _seconds: float = field(default=0.0, repr=False)
    # CUDA collectives are asynchronous: wall-clock around the call would time only the launch, so
    # events are recorded and read once per step, when the step synchronises anyway.
    _events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} must be in [0, world_size {self.world_size})")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums tensor over the ranks, in place; returns it."""
        if self.world_size == 1:
            return tensor
        self._run(lambda: dist.all_reduce(tensor, group=self._require_group()), tensor.device)
        return tensor

    def gather_to_rank0(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Rank 0 gets the ranks' tensors concatenated along dim (in rank order); the others get None."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        group = self._require_group()
        dst = dist.get_global_rank(group, 0)
        self._run(lambda: dist.gather(tensor, parts, dst=dst, group=group), tensor.device)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast_from_rank0(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank gets rank 0's tensor, in place (same shape and dtype on every rank): what only rank
        0 decides, such as a draft model's proposals, which every rank then computes with."""
        if self.world_size == 1:
            return tensor
        group = self._require_group()
        src = dist.get_global_rank(group, 0)
        self._run(lambda: dist.broadcast(tensor, src=src, group=group), tensor.device)
        return tensor

    def take_comm_seconds(self) -> float:
        """Seconds spent in collectives since the last call, then resets the count (once per step)."""
        seconds = self._seconds
        if self._events:
            self._events[-1][1].synchronize()
            seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        self._seconds = 0.0
        return seconds

    def _run(self, collective, device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Into a CUDA graph (shard_worker/cuda_graphs.py): an event recorded in a capture never
            # completes outside a replay, so a replayed step's collectives go untimed.
            collective()
        elif device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            collective()
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            collective()
            self._seconds += time.perf_counter() - t0

    def _require_group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError(
                f"rank {self.rank} of {self.world_size} has no process group: use init_tensor_parallel, "
                "or call the layer's forward_partial to compute this rank's share by hand"
            )
        return self.group


def init_tensor_parallel(rank: int, world_size: int, init_addr: str, device: torch.device) -> TensorParallel:
    """Joins the group of world_size ranks that rendezvous at init_addr ("host:port", served by rank 0).

    NCCL on CUDA, gloo on CPU. world_size 1 starts no torch.distributed at all.
    """
    if world_size == 1:
        return TensorParallel(rank=0, world_size=1)
    host, sep, port = init_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"init_addr must be host:port, got {init_addr!r}")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=INIT_TIMEOUT,
        device_id=torch.device(device) if backend == "nccl" else None,
    )
    return TensorParallel(rank=rank, world_size=world_size, group=dist.group.WORLD)
