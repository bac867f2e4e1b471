"""Falls back to static batching when output throughput falls (the seed's rollback), and back again.

The engine calls observe(now, output_tokens, load) once per step; `mode` says how the next steps should
batch. Plain Python: time is passed in, so a synthetic series drives it in tests.

What is compared
- window: the steps of the last window_s seconds. Throughput = tokens sampled / seconds the steps took
  (each step owns the time since the previous one). A gap longer than max_gap_s is the engine idling with
  nothing to do, not slowness: that step is left out and timing restarts.
- baseline: in continuous mode, the baseline_s of steps just before the window (steps age out of the
  window into it), so the window is never compared with itself and a step change shows fully in the
  window before it reaches the baseline. The last ready baseline is kept as the reference.
- comparable load: `load` is the offered demand (see below). The window is judged only when its load is
  at least (1 - load_band) of the reference's, and against the throughput expected at its own load: the
  reference's, scaled down in proportion when the window's load is lower. Batching more sequences never
  gives each of them more speed, so throughput grows at most in proportion to load and the scaled figure
  never expects too much: fewer requests making fewer tokens is a quiet period, not a regression, even
  while the baseline still straddles the busier period before it. Not scaled up when the load is higher:
  more demand and fewer tokens is a regression (e.g. preemption thrashing, which a bounded static batch
  can cure). ratio = window throughput / expected throughput.
- static mode cannot observe continuous batching, so its window is compared with the reference frozen
  at the switch (the continuous baseline before the drop). Back to continuous when:
    recovered: static's ratio is within `recover` (default 5%, tighter than `drop`: the hysteresis) of
      1, so whatever caused the drop has passed;
    no_gain: static's ratio is a `drop` below (the margin of the switch itself) that of the last quarter
      of the continuous window that caused the switch. The last quarter, because the switch fires as soon
      as the whole window crosses the threshold, so the whole window straddles the drop and always reads
      about 1 - drop, however low continuous had fallen. Static does not help, so the drop is not
      batching's to fix: the reference is dropped and a new baseline forms at the present level (no
      switch until it is ready);
    probe: static has lasted probe_after_s. Static batching is usually slower than healthy continuous
      batching, so `recovered` may never fire even after the cause has passed; only a trial of
      continuous can tell. If the trial drops again, the next probe waits twice as long (capped).
  No switch within min_dwell_s of the last one, and none before the window and a reference are ready
  (warm-up): both are needed, and the window is emptied at every switch so it only holds its mode's steps.

What `load` should be: demand that does not depend on the batching mode, e.g. requests queued in the
router + waiting + running here, capped at max_num_seqs (queued requests past what one step can batch do
not raise attainable throughput, so a growing queue at saturation still reads as the same load). The
scheduler's own waiting + running is not enough in static mode: credit flow control keeps the rest in
the router, so it reads low there and static would look like a quiet period (only probes would end it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

CONTINUOUS = "continuous"
STATIC = "static"

# A window or baseline is judged only once its steps cover at least this share of its length: after
# start-up, a switch or an idle gap, a few steps are not a throughput.
_MIN_COVER = 0.5


@dataclass(frozen=True)
class FallbackPolicy:
    drop: float = 0.10  # switch to static when the window is this far below the reference
    recover: float = 0.05  # back to continuous when static's window is within this of the reference
    # Long enough to average out step-time noise: with per-step times varying by half (prefill chunks
    # among decode steps), a 10 s window read 10% low by chance within 20 minutes; 20 s did not.
    window_s: float = 20.0
    baseline_s: float = 120.0
    min_samples: int = 20  # steps in the window (and in the baseline) before either is judged
    load_band: float = 0.25  # the window's load must be at least (1 - load_band) of the reference's
    min_dwell_s: float = 60.0
    probe_after_s: float | None = 300.0  # None: stay in static until recovered or no_gain
    max_probe_backoff: int = 8  # the probe interval doubles after each failed probe, up to this factor
    max_gap_s: float = 2.0

    def __post_init__(self):
        if not 0.0 < self.drop < 1.0:
            raise ValueError(f"drop must be in (0, 1), got {self.drop}")
        if not 0.0 <= self.recover < self.drop:
            raise ValueError(f"recover must be in [0, drop={self.drop}) for hysteresis, got {self.recover}")
        if not 0.0 <= self.load_band < 1.0:
            raise ValueError(f"load_band must be in [0, 1), got {self.load_band}")
        for name in ("window_s", "baseline_s", "max_gap_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.min_dwell_s < 0:
            raise ValueError(f"min_dwell_s must be >= 0, got {self.min_dwell_s}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be at least 1, got {self.min_samples}")
        if self.probe_after_s is not None and self.probe_after_s <= 0:
            raise ValueError(f"probe_after_s must be positive or None, got {self.probe_after_s}")
        if self.max_probe_backoff < 1:
            raise ValueError(f"max_probe_backoff must be at least 1, got {self.max_probe_backoff}")


@dataclass(frozen=True)
class Switch:
    """One change of mode, with the figures it was decided on (for the log line and the counter)."""

    time: float
    to_mode: str
    reason: str  # "drop", "recovered", "no_gain" or "probe"
    window_tps: float
    window_load: float
    baseline_tps: float  # the reference compared against
    baseline_load: float
    expected_tps: float  # the reference's throughput at the window's load

    @property
    def from_mode(self) -> str:
        return CONTINUOUS if self.to_mode == STATIC else STATIC

    @property
    def change(self) -> float:
        """The window against what was expected at its load: -0.15 is 15% below."""
        return self.window_tps / self.expected_tps - 1.0 if self.expected_tps else math.nan

    def __str__(self) -> str:
        return (
            f"batching {self.from_mode} -> {self.to_mode} ({self.reason}): window {self.window_tps:.1f} "
            f"tok/s at load {self.window_load:.1f}, baseline {self.baseline_tps:.1f} tok/s at load "
            f"{self.baseline_load:.1f}, expected {self.expected_tps:.1f} ({self.change:+.1%})"
        )


@dataclass(frozen=True)
class Figures:
    """What the fallback sees now, for logs and metrics. None where there is nothing to show yet."""

    mode: str
    window_tps: float | None
    window_load: float | None
    baseline_tps: float | None
    baseline_load: float | None
    expected_tps: float | None  # the baseline's throughput at the window's load
    warm: bool  # window and reference are both ready: a switch may be decided

    @property
    def change(self) -> float | None:
        if self.window_tps is None or not self.expected_tps:
            return None
        return self.window_tps / self.expected_tps - 1.0


@dataclass(frozen=True)
class _Step:
    time: float  # when the step ended
    seconds: float
    tokens: int
    load: float


class _Steps:
    """Steps in a time range, with running sums so that each observe costs O(1)."""

    def __init__(self):
        self.steps: deque[_Step] = deque()
        self.clear()

    def clear(self) -> None:
        self.steps.clear()
        self.seconds = 0.0
        self.tokens = 0
        self.load_seconds = 0.0

    def push(self, step: _Step) -> None:
        self.steps.append(step)
        self.seconds += step.seconds
        self.tokens += step.tokens
        self.load_seconds += step.load * step.seconds

    def pop_older(self, edge: float) -> list[_Step]:
        """Removes and returns the steps that ended at or before `edge`."""
        out = []
        while self.steps and self.steps[0].time <= edge:
            step = self.steps.popleft()
            self.seconds -= step.seconds
            self.tokens -= step.tokens
            self.load_seconds -= step.load * step.seconds
            out.append(step)
        if not self.steps:
            self.clear()  # no float residue left behind
        return out

    def tail(self, seconds: float) -> tuple[float, float]:
        """Throughput and load of the steps of the last `seconds` (at least one step)."""
        secs = tokens = load_secs = 0.0
        for step in reversed(self.steps):
            secs += step.seconds
            tokens += step.tokens
            load_secs += step.load * step.seconds
            if secs >= seconds:
                break
        return (tokens / secs, load_secs / secs) if secs > 0 else (0.0, 0.0)

    def ready(self, length_s: float, min_samples: int) -> bool:
        return len(self.steps) >= min_samples and self.seconds >= _MIN_COVER * length_s

    @property
    def tps(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def load(self) -> float | None:
        return self.load_seconds / self.seconds if self.seconds > 0 else None


class ThroughputFallback:
    def __init__(self, policy: FallbackPolicy | None = None, history: int = 64):
        self.policy = policy or FallbackPolicy()
        self._mode = CONTINUOUS
        self._window = _Steps()
        self._baseline = _Steps()
        self._reference: tuple[float, float] | None = None  # (tokens/s, load) of the last ready baseline
        self._trigger_ratio = 1.0  # how low continuous had fallen at the switch (see no_gain)
        self._last_time: float | None = None
        self._switched_at = -math.inf
        self._probing = False  # back in continuous on a probe, not yet confirmed by a new baseline
        self._backoff = 1
        self.num_switches = 0
        self.events: deque[Switch] = deque(maxlen=history)  # the latest switches, oldest first

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def figures(self) -> Figures:
        ref = self._reference
        tps, load = self._window.tps, self._window.load
        return Figures(
            mode=self._mode,
            window_tps=tps,
            window_load=load,
            baseline_tps=None if ref is None else ref[0],
            baseline_load=None if ref is None else ref[1],
            expected_tps=None if ref is None or load is None else self._expected(load),
            warm=ref is not None and self._window_ready(),
        )

    def observe(self, now: float, output_tokens: int, load: float) -> Switch | None:
        """One engine step that ended at `now` and sampled `output_tokens` tokens under `load`.
        Returns the switch it caused, if any (also in `events`); `mode` then gives the new mode."""
        if output_tokens < 0 or load < 0:
            raise ValueError(f"output_tokens ({output_tokens}) and load ({load}) must be >= 0")
        prev, self._last_time = self._last_time, now
        if prev is not None and now < prev:
            raise ValueError(f"time went backwards: {now} after {prev}")
        if prev is not None and now - prev <= self.policy.max_gap_s:
            self._window.push(_Step(now, now - prev, output_tokens, load))
        self._expire(now)
        return self._decide(now)

    def interrupt(self) -> None:
        """Something other than batching stalled the engine (a rank was lost and everything is being
        recomputed): forget the clock and the window, keep the reference."""
        self._last_time = None
        self._window.clear()

    # ---- internals ----

    def _expire(self, now: float) -> None:
        p = self.policy
        aged = self._window.pop_older(now - p.window_s)
        if self._mode == CONTINUOUS:
            for step in aged:
                self._baseline.push(step)
        self._baseline.pop_older(now - p.window_s - p.baseline_s)
        if self._mode == CONTINUOUS and self._baseline.ready(p.baseline_s, p.min_samples):
            if self._baseline.tps:
                self._reference = (self._baseline.tps, self._baseline.load)
            if self._probing:  # continuous has held up for a whole baseline: the probe succeeded
                self._probing = False
                self._backoff = 1

    def _window_ready(self) -> bool:
        return self._window.ready(self.policy.window_s, self.policy.min_samples)

    def _expected(self, load: float) -> float:
        ref_tps, ref_load = self._reference
        return ref_tps * min(1.0, load / ref_load) if ref_load > 0 else ref_tps

    def _ratio(self) -> float | None:
        """The window's throughput over what the reference would give at its load; None when the window
        or the reference is not ready, or the loads are not comparable."""
        if self._reference is None or not self._window_ready():
            return None
        load = self._window.load
        if load < (1.0 - self.policy.load_band) * self._reference[1]:
            return None
        return self._window.tps / self._expected(load)

    def _decide(self, now: float) -> Switch | None:
        p = self.policy
        if now - self._switched_at < p.min_dwell_s:
            return None
        ratio = self._ratio()
        if self._mode == CONTINUOUS:
            if ratio is not None and ratio <= 1.0 - p.drop:
                return self._switch(now, STATIC, "drop")
            return None
        if ratio is not None and ratio >= 1.0 - p.recover:
            return self._switch(now, CONTINUOUS, "recovered")
        if ratio is not None and ratio <= (1.0 - p.drop) * self._trigger_ratio:
            return self._switch(now, CONTINUOUS, "no_gain")
        waited = now - self._switched_at
        if p.probe_after_s is not None and self._window_ready() and waited >= p.probe_after_s * self._backoff:
            return self._switch(now, CONTINUOUS, "probe")
        return None

    def _switch(self, now: float, to_mode: str, reason: str) -> Switch:
        tps, load = self._window.tps, self._window.load
        ref_tps, ref_load = self._reference
        expected = self._expected(load)
        event = Switch(now, to_mode, reason, tps, load, ref_tps, ref_load, expected)
        if reason == "drop":
            recent_tps, recent_load = self._window.tail(self.policy.window_s / 4)
            recent_expected = self._expected(recent_load)
            self._trigger_ratio = recent_tps / recent_expected if recent_expected > 0 else tps / expected
            if self._probing:
                self._backoff = min(2 * self._backoff, self.policy.max_probe_backoff)
            else:
                self._backoff = 1
        self._probing = reason == "probe"
        if reason in ("recovered", "no_gain"):
            self._backoff = 1
        if reason == "no_gain":
            self._reference = None  # the drop is not batching's to fix: judge against a new baseline
        # Each mode is judged on its own steps only; in static mode the baseline stays frozen.
        self._window.clear()
        self._baseline.clear()
        self._mode = to_mode
        self._switched_at = now
        self.num_switches += 1
        self.events.append(event)
        return event
