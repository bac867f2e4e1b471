"""How fast a replica runs, measured by its workers before it serves: the one record of it, from the
worker's warm-up (shard_worker/warm_up.py measure_speed) through the scheduler (the slowest rank's) to
the router's admission estimates (router/slo.py), which use it until requests have measured the replica.

A prefill rate (prompt tokens a second, one long prompt alone) and the decode step's seconds at a few
batch sizes, on a short context. Both leave out what a real stream adds (longer contexts, the
scheduler's own work, the stream): the router's bias quantiles correct the estimates as requests
finish. Plain Python: no protobuf import (`fill` / `from_message` are the only code that knows the wire
form, the DescribeResponse's fields and the StackSpeed message share their names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StackSpeed:
    prefill_tokens_per_second: float = 0.0  # 0: not measured
    # (batch size, decode step seconds), batch sizes ascending; empty: not measured.
    decode: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        p = self.prefill_tokens_per_second
        if not (math.isfinite(p) and p >= 0):
            raise ValueError(f"prefill_tokens_per_second must be finite and >= 0, got {p!r}")
        sizes = [n for n, _ in self.decode]
        if sizes != sorted(set(sizes)) or any(n < 1 for n in sizes):
            raise ValueError(f"decode batch sizes must be ascending integers >= 1, got {sizes}")
        if any(not (math.isfinite(s) and s > 0) for _, s in self.decode):
            raise ValueError("decode step seconds must be finite and > 0")

    @property
    def known(self) -> bool:
        return self.prefill_tokens_per_second > 0 and bool(self.decode)

    def step_seconds(self, sequences: int) -> float:
        """A decode step's seconds with `sequences` in the batch: linear between the measured sizes,
        and past the largest along the line through the last two (a step grows with its batch)."""
        points = self.decode
        if not points:
            return 0.0
        if sequences <= points[0][0] or len(points) == 1:
            n, s = points[0] if sequences <= points[0][0] else points[-1]
            return s if sequences <= n else s * sequences / n
        for (n0, s0), (n1, s1) in zip(points, points[1:], strict=False):
            if sequences <= n1:
                return s0 + (s1 - s0) * (sequences - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = points[-2], points[-1]
        return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (sequences - n1)

    def prefill_seconds(self, tokens: int) -> float:
        """A prompt of `tokens` alone (0 when not measured)."""
        rate = self.prefill_tokens_per_second
        return tokens / rate if rate > 0 else 0.0

    @classmethod
    def slowest(cls, speeds: list[StackSpeed]) -> StackSpeed:
        """Of several ranks, which step together: the lowest rate and, per batch size all measured, the
        longest step. Not measured when any rank did not measure."""
        if not speeds or not all(s.known for s in speeds):
            return cls()
        sizes = set.intersection(*({n for n, _ in s.decode} for s in speeds))
        decode = tuple((n, max(dict(s.decode)[n] for s in speeds)) for n in sorted(sizes))
        return cls(min(s.prefill_tokens_per_second for s in speeds), decode)

    def fill(self, message) -> None:
        message.prefill_tokens_per_second = self.prefill_tokens_per_second
        message.decode_batch_sizes[:] = [n for n, _ in self.decode]
        message.decode_step_seconds[:] = [s for _, s in self.decode]

    @classmethod
    def from_message(cls, message) -> StackSpeed:
        """ValueError when the message's fields are not a speed a worker can measure."""
        sizes, seconds = list(message.decode_batch_sizes), list(message.decode_step_seconds)
        if len(sizes) != len(seconds):
            raise ValueError(f"{len(sizes)} decode batch sizes for {len(seconds)} step times")
        return cls(message.prefill_tokens_per_second, tuple(zip(sizes, seconds, strict=True)))
