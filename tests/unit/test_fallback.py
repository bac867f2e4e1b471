"""The static-batching fallback, driven by synthetic throughput series: plain Python, time passed in."""

import random

import pytest

from scheduler.fallback import CONTINUOUS, STATIC, FallbackPolicy, ThroughputFallback

TPS = 1600.0  # healthy throughput: 32 running sequences, one token each per 20 ms step
LOAD = 32


class Clock:
    """Drives a fallback like the engine loop: one observe per step, each step sampling one token per
    running sequence and taking as long as the given throughput implies."""

    def __init__(self, fb: ThroughputFallback, seed: int = 0):
        self.fb = fb
        self.t = 1000.0
        self.rng = random.Random(seed)
        self.switches = []

    def run(
        self, seconds: float, tps: float = TPS, load: int = LOAD, jitter: float = 0.0, stalls: float = 0.0
    ):
        """jitter: each step's time varies by up to this share either way; stalls: the share of steps
        that take 5 times as long (a long prefill chunk, a GC pause)."""
        end = self.t + seconds
        while self.t < end:
            step_s = load / tps * (1.0 + self.rng.uniform(-jitter, jitter))
            if stalls and self.rng.random() < stalls:
                step_s *= 5
            self.t += step_s
            event = self.fb.observe(self.t, load, load)
            if event is not None:
                self.switches.append(event)
        return self


def warmed(policy=None, seed=0, **noise) -> Clock:
    """A fallback that has seen a full window and baseline of healthy steps (with the given noise)."""
    clock = Clock(ThroughputFallback(policy), seed)
    p = clock.fb.policy
    clock.run(p.window_s + p.baseline_s, **(noise or {"jitter": 0.1}))
    assert clock.fb.figures.warm and not clock.switches
    return clock


def drop(clock: Clock, level: float = 0.85) -> None:
    """One window at a lower throughput: enough for the switch to static."""
    clock.run(clock.fb.policy.window_s, tps=level * TPS)
    assert [e.reason for e in clock.switches][-1:] == ["drop"]


def test_steady_throughput_never_switches():
    clock = warmed().run(600, jitter=0.1)
    assert clock.fb.mode == CONTINUOUS and clock.fb.num_switches == 0 and not clock.fb.events
    figures = clock.fb.figures
    assert figures.window_tps == pytest.approx(TPS, rel=0.02)
    assert figures.baseline_tps == pytest.approx(TPS, rel=0.02)
    assert figures.window_load == pytest.approx(LOAD)
    assert abs(figures.change) < 0.02


def test_drop_of_15_percent_switches_to_static_within_a_window_with_its_figures():
    clock = warmed()
    start = clock.t
    clock.run(clock.fb.policy.window_s, tps=0.85 * TPS)
    assert clock.fb.mode == STATIC
    assert clock.fb.num_switches == 1 and len(clock.switches) == 1
    event = clock.switches[0]
    assert list(clock.fb.events) == [event]
    assert (event.from_mode, event.to_mode, event.reason) == (CONTINUOUS, STATIC, "drop")
    assert start < event.time <= start + clock.fb.policy.window_s
    # The window crossed the threshold part way through the drop: between the drop and the threshold.
    assert 0.85 * TPS <= event.window_tps <= 0.90 * TPS
    assert event.baseline_tps == pytest.approx(TPS, rel=0.02)
    assert event.change <= -0.10
    assert event.window_load == pytest.approx(LOAD) and event.baseline_load == pytest.approx(LOAD)
    assert "continuous -> static (drop)" in str(event)


def test_drop_of_5_percent_does_not_switch():
    clock = warmed().run(600, tps=0.95 * TPS, jitter=0.1)
    assert clock.fb.mode == CONTINUOUS and clock.fb.num_switches == 0


def test_threshold_is_configurable():
    clock = warmed(FallbackPolicy(drop=0.04, recover=0.02)).run(30, tps=0.95 * TPS)
    assert [e.reason for e in clock.switches] == ["drop"]


def test_drop_from_fewer_requests_is_a_quiet_period_not_a_regression():
    # Half the requests: fewer sequences per step, so fewer tokens per second, though each step is faster.
    clock = warmed().run(600, tps=0.6 * TPS, load=16, jitter=0.1)
    assert clock.fb.mode == CONTINUOUS and clock.fb.num_switches == 0
    # The baseline has moved to the quieter level meanwhile, and the busy level coming back is no drop.
    assert clock.fb.figures.baseline_load == pytest.approx(16)
    clock.run(300, jitter=0.1)
    assert clock.fb.num_switches == 0


def test_drop_under_more_load_is_a_regression():
    # More requests and fewer tokens (e.g. preemption thrashing): exactly what a bounded batch can cure.
    clock = warmed().run(10, tps=0.8 * TPS, load=64)
    assert [e.reason for e in clock.switches] == ["drop"]
    assert clock.switches[0].window_load > clock.switches[0].baseline_load


def test_recovery_switches_back_after_the_dwell_time():
    clock = warmed()
    drop(clock)
    assert clock.fb.mode == STATIC
    dropped_at = clock.switches[0].time
    clock.run(120, jitter=0.1)  # static batching delivers the old throughput again
    assert [e.reason for e in clock.switches] == ["drop", "recovered"]
    back = clock.switches[1]
    dwell = clock.fb.policy.min_dwell_s
    assert dropped_at + dwell <= back.time <= dropped_at + dwell + 1.0
    assert (back.from_mode, back.to_mode) == (STATIC, CONTINUOUS)
    assert back.window_tps >= 0.95 * back.baseline_tps
    assert clock.fb.mode == CONTINUOUS and clock.fb.num_switches == 2
    clock.run(600, jitter=0.1)
    assert clock.fb.num_switches == 2


def test_partial_recovery_stays_static_no_flapping():
    # Static gives 92%: within the drop threshold, but not within the 5% needed to go back (hysteresis).
    clock = warmed(FallbackPolicy(probe_after_s=None))
    drop(clock)
    clock.run(600, tps=0.92 * TPS, jitter=0.1)
    assert [e.reason for e in clock.switches] == ["drop"] and clock.fb.mode == STATIC


def test_noisy_series_around_a_constant_never_switches():
    for seed in range(3):
        clock = warmed(seed=seed, jitter=0.5, stalls=0.01).run(1200, jitter=0.5, stalls=0.01)
        assert clock.fb.num_switches == 0, clock.switches


def test_noisy_drop_switches_once():
    clock = warmed(FallbackPolicy(probe_after_s=None), jitter=0.5, stalls=0.01)
    clock.run(600, tps=0.85 * TPS, jitter=0.5, stalls=0.01)
    assert [e.reason for e in clock.switches] == ["drop"]


def test_warm_up_does_not_switch():
    clock = Clock(ThroughputFallback())
    clock.run(10)
    assert not clock.fb.figures.warm and clock.fb.figures.baseline_tps is None
    clock.run(60, tps=0.7 * TPS)  # a drop before any baseline is ready is no drop
    assert clock.fb.num_switches == 0 and clock.fb.mode == CONTINUOUS


def test_idle_gap_is_not_a_drop():
    clock = warmed()
    clock.t += 30.0  # nothing to do: the engine waits for requests
    clock.run(60)
    clock.t += 1.0  # a short wait, within max_gap_s: counted, but it is one step among hundreds
    clock.run(60)
    assert clock.fb.num_switches == 0


def test_static_without_gain_goes_back_and_rebases():
    clock = warmed(FallbackPolicy(probe_after_s=None))
    drop(clock)
    clock.run(100, tps=0.7 * TPS)  # static is worse than the degraded continuous it replaced
    assert [e.reason for e in clock.switches] == ["drop", "no_gain"]
    assert clock.fb.figures.baseline_tps is None  # the old reference is gone: a new one forms
    clock.run(600, tps=0.85 * TPS, jitter=0.1)  # the degraded level is the new normal: no flapping
    assert clock.fb.num_switches == 2 and clock.fb.mode == CONTINUOUS
    assert clock.fb.figures.baseline_tps == pytest.approx(0.85 * TPS, rel=0.02)


def test_static_that_helps_after_a_severe_drop_stays():
    # Continuous fell to half; static gives 70%: short of recovered, but far better than what it replaced.
    clock = warmed(FallbackPolicy(probe_after_s=None))
    drop(clock, 0.5)
    clock.run(600, tps=0.7 * TPS, jitter=0.1)
    assert [e.reason for e in clock.switches] == ["drop"] and clock.fb.mode == STATIC


def test_probe_retries_continuous_with_backoff():
    policy = FallbackPolicy(probe_after_s=100.0)
    clock = warmed(policy)
    drop(clock)
    # Static is better than the degraded continuous (no no_gain) but never within 5% of the old baseline.
    clock.run(100 + 2, tps=0.9 * TPS)
    assert [e.reason for e in clock.switches] == ["drop", "probe"]
    assert clock.switches[1].time - clock.switches[0].time == pytest.approx(100.0, abs=0.1)
    clock.run(policy.min_dwell_s + 1, tps=0.85 * TPS)  # continuous is still degraded: the probe fails
    assert [e.reason for e in clock.switches] == ["drop", "probe", "drop"]
    clock.run(150, tps=0.9 * TPS)  # the next probe waits twice as long
    assert clock.fb.num_switches == 3
    clock.run(60, tps=0.9 * TPS)
    assert [e.reason for e in clock.switches][-1] == "probe"
    assert clock.switches[-1].time - clock.switches[-2].time == pytest.approx(200.0, abs=0.1)
    clock.run(600, jitter=0.1)  # the cause has passed: continuous holds
    assert clock.fb.mode == CONTINUOUS and clock.fb.num_switches == 4


def test_interrupt_forgets_the_window_but_keeps_the_reference():
    clock = warmed()
    clock.fb.interrupt()
    assert clock.fb.figures.window_tps is None and clock.fb.figures.baseline_tps == pytest.approx(TPS, 0.02)
    clock.run(5, tps=0.2 * TPS)  # recompute after a lost rank: the window is not yet ready to judge
    assert clock.fb.num_switches == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"drop": 0.0},
        {"drop": 0.1, "recover": 0.1},
        {"load_band": 1.0},
        {"window_s": 0},
        {"min_samples": 0},
        {"probe_after_s": 0},
        {"min_dwell_s": -1},
        {"max_probe_backoff": 0},
    ],
)
def test_bad_policy_is_refused(kw):
    with pytest.raises(ValueError):
        FallbackPolicy(**kw)


def test_bad_observation_is_refused():
    fb = ThroughputFallback()
    fb.observe(1.0, 1, 1)
    with pytest.raises(ValueError):
        fb.observe(0.5, 1, 1)
    with pytest.raises(ValueError):
        fb.observe(2.0, -1, 1)


def test_idle_steps_with_no_load_are_not_judged():
    clock = warmed()
    for _ in range(5000):
        clock.t += 0.02
        assert clock.fb.observe(clock.t, 0, 0) is None
    assert clock.fb.num_switches == 0 and clock.fb.figures.window_load == 0
