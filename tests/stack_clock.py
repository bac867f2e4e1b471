"""The stack's own measure of its speed, as a client sees it: the scheduler's steps and their seconds,
sampled through GetStats. Tests judge a wait against it (`work_s`) instead of wall-clock constants: on a
shared machine other processes slow the stack 2x and more within seconds, which is no fault of the
server; time it spent idle or outside its steps stays counted."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from common.pb.tpserve.v1 import generation_pb2 as pb

STATS_EVERY_S = 0.1  # how often the client samples the stack's step counters


class StackClock:
    """The scheduler's steps and their seconds, cumulative, sampled by the client (GetStats): how fast
    the stack itself ran over any stretch of the test."""

    def __init__(self):
        self.at: list[float] = []
        self.steps: list[float] = []
        self.seconds: list[float] = []

    async def sample(self, stub) -> None:
        stats = await stub.GetStats(pb.StatsRequest(), timeout=10)
        self.at.append(time.perf_counter())
        self.steps.append(stats.num_steps_total)
        self.seconds.append(stats.step_seconds_total)

    async def run(self, stub) -> None:
        while True:
            await self.sample(stub)
            await asyncio.sleep(STATS_EVERY_S)

    def between(self, start: float, end: float) -> tuple[float, float]:
        """(steps, their seconds) the stack ran between start and end (interpolated between samples)."""
        steps = np.interp([start, end], self.at, self.steps)
        seconds = np.interp([start, end], self.at, self.seconds)
        return float(steps[1] - steps[0]), float(seconds[1] - seconds[0])

    def mean_step(self, start: float, end: float) -> float | None:
        """The stack's mean step between start and end (None: fewer than 3 steps ran)."""
        steps, seconds = self.between(start, end)
        return seconds / steps if steps >= 3 else None

    def work_s(self, start: float, end: float, promised_step: float) -> float:
        """The wait from start to end less what the steps run meanwhile took beyond promised_step (the
        step time the stack ran at when it made its promise)."""
        steps, seconds = self.between(start, end)
        return (end - start) - max(0.0, seconds - steps * promised_step)
