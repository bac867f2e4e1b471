"""Which scheduler drives this worker: a lease, taken and checked under the worker's device lock.

A scheduler's start is several calls (Describe, InitCache, then the Step stream), and the ranks of a
group answer Describe at different times; a second scheduler's Describe or InitCache anywhere in between
would resize or empty a cache the first is about to step. So the first call takes the lease, and every
call after it (LoRA loads and unloads too) must come from its holder: another caller gets
FAILED_PRECONDITION naming the holder. It is held for as long as the holder's Step stream is open, and
IDLE_S after the end of the holder's last call otherwise (the gap between Describe and Step, a Describe of
another rank that takes longer; a scheduler that died before stepping).

A scheduler names itself by where it serves (host:port) and an epoch (its start time): the same name
with a later epoch is that scheduler restarted (by the launcher or Kubernetes, in place) and takes the
lease at once, so a restart never waits; an earlier epoch is the old process, refused. Another name waits
for the lease to lapse. Plain Python; the servicer holds the device lock around every call here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# How long a lease outlives its holder's last call while it has no Step stream open.
IDLE_S = 10.0


@dataclass(frozen=True)
class Caller:
    name: str  # where the scheduler serves (host:port); "" when the call named none
    epoch: int  # when that scheduler process started (ns): a restart has a later one

    def __str__(self) -> str:
        return f"scheduler {self.name} (epoch {self.epoch})" if self.name else "an unnamed caller"


class LeaseRefused(Exception):
    """Another scheduler holds the worker (the message names it)."""


class Lease:
    def __init__(self, idle_s: float = IDLE_S, clock=time.monotonic):
        self.idle_s, self._clock = idle_s, clock
        self.holder: Caller | None = None
        self.stepping = False  # the holder's Step stream is open: the lease does not lapse
        self._expires = 0.0

    def take(self, caller: Caller, what: str) -> None:
        """Makes caller the holder, or LeaseRefused (what: the refused action, for the message)."""
        now, holder = self._clock(), self.holder
        if holder is not None and holder != caller:
            restarted = caller.name == holder.name and caller.epoch > holder.epoch
            lapsed = not self.stepping and now >= self._expires
            if not (restarted or lapsed):
                held = "is stepping it" if self.stepping else f"holds it for {self._expires - now:.0f}s more"
                raise LeaseRefused(f"{holder} {held}; {caller} may not {what} this worker")
            self.stepping = False  # the old holder's stream, if still open, ends at its next step
        self.holder = caller
        self._expires = now + self.idle_s

    def renew(self, caller: Caller) -> None:
        """At the end of a long call of the holder's: the idle time counts from there."""
        if self.holder == caller:
            self._expires = self._clock() + self.idle_s

    def start_stepping(self, caller: Caller) -> None:
        """The Step stream opens: caller must hold the lease (or take it, lapsed), and keeps it while open."""
        self.take(caller, "step")
        self.stepping = True

    def stop_stepping(self, caller: Caller) -> None:
        """The Step stream ended: the lease lapses IDLE_S later unless its holder calls again."""
        if self.holder == caller:
            self.stepping = False
            self._expires = self._clock() + self.idle_s

    def holds(self, caller: Caller) -> bool:
        return self.holder == caller
