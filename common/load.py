"""A replica's load: the one record of it, from the scheduler's counts to the router's choice.

The scheduler builds it from its SchedulerSnapshot after each step (scheduler/reports.py), sends it when
it changed and as the heartbeat (scheduler/router_streams.py) as a LoadReport message (`fill` /
`from_message`, the only two places that know the wire form), and the router keeps the last one per
replica (router/replicas.py). It is checked once, where it is made. Plain Python: no protobuf import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

_COUNTS = ("waiting", "running", "swapped", "kv_blocks_free", "kv_blocks_total")


@dataclass(frozen=True)
class ReplicaLoad:
    """One scheduler's report of its load, sent on its stream after steps and as a heartbeat when idle."""

    waiting: int  # sequences the scheduler holds that are not running (not counting the router's queue)
    running: int  # sequences in the running batch
    kv_blocks_free: int  # KV blocks no sequence holds
    kv_blocks_total: int  # KV blocks in the pool (0 before the shards have reported)
    max_num_seqs: int  # the scheduler's cap on running sequences
    # Recent time per step (the mean of the last few, to the millisecond, so that a report only differs
    # from the last when something an operator would see changed); 0.0 when idle.
    step_seconds: float
    shards_ready: bool  # every rank connected and serving
    swapped: int = 0  # preempted sequences swapped to host, each to come back before new ones start

    def __post_init__(self):
        for name in _COUNTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        n = self.max_num_seqs
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {n!r}")
        if self.kv_blocks_free > self.kv_blocks_total:
            raise ValueError(
                f"kv_blocks_free ({self.kv_blocks_free}) exceeds kv_blocks_total ({self.kv_blocks_total})"
            )
        if not (math.isfinite(self.step_seconds) and self.step_seconds >= 0):
            raise ValueError(f"step_seconds must be finite and >= 0, got {self.step_seconds!r}")

    def fill(self, message) -> None:
        """Writes this load into a LoadReport message (scheduler.proto), field for field."""
        for f in fields(self):
            setattr(message, f.name, getattr(self, f.name))

    @classmethod
    def from_message(cls, message) -> ReplicaLoad:
        """The load a LoadReport message carries; ValueError when it is not one a scheduler can send."""
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})
