"""Latency objectives: what each request is promised, whether the router can keep the promise, and which
replicas may take more decode load. Plain Python: no gRPC, no asyncio; the clock is an argument.

Objectives. A request carries a TTFT objective, a TPOT objective (ms; 0: none) and vLLM's priority (lower
is served first). Unset objectives take the server's default for the prompt's length bucket
(--slo-ttft-ms / --slo-tpot-ms: one value for every bucket, or one per bucket, shortest first).

Admission (`SloEstimator.refusal`). When a request arrives the router predicts its time to first token:

    predicted_ttft = queue_wait + first_token_s
    queue_wait     = max(0, ahead + 1 - free_slots) / drain_rate
    drain_rate     = sum over up replicas of running / service_s

- ahead: requests that leave the router's queue before it (higher priorities, and its own in its bucket
  and the shorter ones: AdmissionQueue.ahead) plus those the schedulers hold waiting; free_slots:
  requests the replicas would take now (their credit).
- first_token_s: the recent time from sending a request to a replica to its first token (queue there
  and prefill), per replica (an EWMA; the best replica's, since the choice is made when it leaves the queue).
- service_s: the recent time from sending a request to its end (an EWMA, per replica). A replica serving
  `running` sequences at once finishes about running / service_s requests a second. When a queue forms the
  replica runs the batch it can (max_num_seqs, or fewer where the TPOT gate or memory holds it), so its
  running count is that batch; with max_num_seqs instead, a gated replica's drain was overestimated about
  3x (35 running of 128; session 9: admitted TTFT p99 2.9 s against a 2 s objective). A rate measured from
  completions would instead learn the offered load and refuse ever more.
- Nothing measured yet (no request has finished): admitted, as nothing says it will miss.
- A request that would start at once (nothing ahead, a replica with room that takes decode load) is
  admitted whatever first_token_s says: refusing it cannot serve it sooner, and only admitted requests
  refresh first_token_s (a slow spell measured once would otherwise refuse every later request).
- The model is crude (credit round trips, the router's own loop and other processes on the host slow the
  drain), so the prediction is scaled by `bias`: a high quantile (`ttft_quantile`, 0.97; within [0.5, 4]) of
  the recent ratios (the last `window`, 64) of each request's actual TTFT at the router to what was
  predicted for it when it arrived. A quantile rather than a mean, because the promise is each request's:
  with an EWMA of the ratios (session 9, 2x the sustainable rate) the prediction was right on average and
  the admitted requests' TTFT p99 was 2.36 s against a 2 s objective; with the 0.9 quantile (session 10)
  still 2.7 s at 2x, 1.95 s with 0.97. It rises once two of the window ran late, and falls as the window
  forgets.
A request whose prediction exceeds its objective is refused at once, with the prediction in the reason and
`retry_after_s` (the time for the queue ahead to drain to where it would fit).

Decode load (`SloEstimator.takes_decode`). A replica whose step (one token for each running sequence),
projected to the batch it would run with the requests waiting there, those sent since its last report and
one more, is slower than the tightest TPOT objective of the requests it holds, times `slo_tpot_margin`
(0.9), is offered no new request until its batch drains: one more sequence would slow every one it holds. The
projection scales the recent step by (sequences + fixed) / (running + fixed), `fixed_sequences` being a
step's fixed cost (the weights read once per step) in sequences' worth. Measured before the projection
(session 9, SmolLM2 bf16, 2x the sustainable Poisson rate): admitted requests' TPOT p50 226 ms against a
200 ms objective, every report opening the gate to a burst of admissions made on it. The projection is
scaled by `tpot_bias`, a high quantile (`tpot_quantile`, 0.97; within [0.5, 4]) of the recent ratios of a
finished request's TPOT to the mean step its replica reported while it decoded: the scheduler's own work
between steps and the stream are in what clients see, not in the step. And it is never below what the
recent reports' average (an EWMA of the step per sequence) projects: with a queue always waiting, every
report that happened to be fast was taken at once, so admissions followed the step's lucky dips (session
10, 3x: TPOT p50 200 ms with the gate at 180).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from common.load import ReplicaLoad
from common.settings import Rule, between, setting

_MS = Rule(lambda v: all(isinstance(x, int) and x >= 0 for x in v), "integers >= 0 (milliseconds)")


@dataclass(frozen=True)
class SloPolicy:
    """Server-wide defaults (the router's and `tpserve launch`'s flags)."""

    slo_ttft_ms: tuple[int, ...] = setting(
        (0,),
        help="default time-to-first-token objective (ms) of a request that sends none: one value, or one "
        "per length bucket, shortest first (0: none); a request predicted to miss it is refused",
        rule=_MS,
        launch=True,
    )
    slo_tpot_ms: tuple[int, ...] = setting(
        (0,),
        help="default time-per-output-token objective (ms), one value or one per length bucket (0: "
        "none); a replica stepping slower than its requests' tightest objective takes no new ones",
        rule=_MS,
        launch=True,
    )
    slo_tpot_margin: float = setting(
        0.9,
        help="a replica takes no new request while its step, grown by what it would take on, exceeds "
        "this share of the tightest TPOT objective it holds (lower: fewer requests' TPOT past it, a "
        "smaller batch)",
        rule=between(0, 1, low_open=True),
        launch=True,
    )
    # A step's fixed cost (weights read once for the whole batch) in sequences' worth: a step of n sequences
    # takes about (n + fixed_sequences) units. SmolLM2 on 2 CPU cores in bf16: 45, 71 and 140 ms at 1, 8
    # and 32 sequences (TPOT p50, session 8), about 14; taken lower, so the growth is overestimated.
    fixed_sequences: float = 8.0
    alpha: float = 0.2  # EWMA weight of each new measurement
    # The TTFT prediction's scale: this quantile of the last `window` ratios of actual to predicted TTFT;
    # the TPOT gate's: this quantile of the last `window` ratios of a request's TPOT to its replica's step.
    ttft_quantile: float = 0.97
    tpot_quantile: float = 0.97
    window: int = 64

    def check(self, num_buckets: int) -> None:
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if len(v) not in (0, 1, num_buckets):
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} takes one value or one per length bucket ({num_buckets}), got {len(v)}"
                )


@dataclass(frozen=True)
class Objectives:
    """What one request is promised. Seconds; None: no objective."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    priority: int = 0

    @property
    def any(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


def _default(values: tuple[int, ...], bucket: int) -> int:
    if not values:
        return 0
    return values[0] if len(values) == 1 else values[min(bucket, len(values) - 1)]


def resolve(
    policy: SloPolicy, bucket: int, ttft_ms: int | None, tpot_ms: int | None, priority: int
) -> Objectives:
    """A request's objectives: what it sent (None: not sent), else its bucket's default; 0 is none."""
    ttft = _default(policy.slo_ttft_ms, bucket) if ttft_ms is None else ttft_ms
    tpot = _default(policy.slo_tpot_ms, bucket) if tpot_ms is None else tpot_ms
    return Objectives(ttft / 1000 if ttft else None, tpot / 1000 if tpot else None, priority)


NO_OBJECTIVES = Objectives()


def ttft_budget_ms(objectives: Objectives, waited_s: float) -> int:
    """What is left of the TTFT objective after waiting waited_s in the router (at least 1 ms; 0: none):
    the scheduler's deadline for the first token is its arrival there plus this."""
    if objectives.ttft_s is None:
        return 0
    return max(1, round((objectives.ttft_s - waited_s) * 1000))


def quantile(values, q: float) -> float:
    """The q-quantile of values (not empty), the nearest rank above: of 64 ratios, q 0.97 is the 63rd."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _batch(load: ReplicaLoad) -> int:
    """The sequences a replica serves at once now: its running batch (which the TPOT gate or its memory
    may hold well under max_num_seqs), at least 1."""
    return max(1, min(load.max_num_seqs, load.running))


class SloRefused(Exception):
    """The request would miss its TTFT objective: refused at once (RESOURCE_EXHAUSTED, HTTP 429)."""

    def __init__(self, reason: str, retry_after_s: float):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


@dataclass
class _Rates:
    first_token_s: float | None = None  # EWMA: sent -> first token
    service_s: float | None = None  # EWMA: sent -> end
    holding: dict[str, float] = field(default_factory=dict)  # request id -> its TPOT objective (s)
    last_step: tuple[float, int] | None = None  # the last step time reported and its running batch
    unit_s: float | None = None  # EWMA over reports of step / (running + fixed): one sequence's worth
    # The reported step time integrated over time (step_sum at step_at, step_now since), and for each
    # request decoding there, that integral and the time at its first token: the mean step it saw.
    step_sum: float = 0.0
    step_at: float | None = None
    step_now: float = 0.0
    decoding: dict[str, tuple[float, float]] = field(default_factory=dict)

    def step_integral(self, now: float) -> float:
        return self.step_sum + (self.step_now * (now - self.step_at) if self.step_at is not None else 0.0)


class SloEstimator:
    def __init__(self, policy: SloPolicy | None = None):
        self.policy = policy or SloPolicy()
        self._replicas: dict[str, _Rates] = {}
        self._ratios: deque[float] = deque(maxlen=self.policy.window)  # actual TTFT / predicted
        self.bias = 1.0  # their ttft_quantile, within [0.5, 4]
        self._tpot_ratios: deque[float] = deque(maxlen=self.policy.window)  # TPOT / mean reported step
        self.tpot_bias = 1.0  # their tpot_quantile, within [0.5, 4]

    def observed_ttft(self, predicted_s: float, actual_s: float) -> None:
        """A request's TTFT at the router, and what predict_ttft said when it arrived."""
        if predicted_s > 0:
            self._ratios.append(actual_s / predicted_s)
            self.bias = min(4.0, max(0.5, quantile(self._ratios, self.policy.ttft_quantile)))

    def _rates(self, replica: str) -> _Rates:
        return self._replicas.setdefault(replica, _Rates())

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.policy.alpha * (new - old)

    # ---- what the router measures ----

    def sent(self, replica: str, request_id: str, objectives: Objectives) -> None:
        if objectives.tpot_s is not None:
            self._rates(replica).holding[request_id] = objectives.tpot_s

    def reported(self, replica: str, load: ReplicaLoad, now: float) -> None:
        """A load report from replica: its step time, integrated for the TPOT its requests see."""
        r = self._rates(replica)
        r.step_sum, r.step_at, r.step_now = r.step_integral(now), now, load.step_seconds
        if load.step_seconds > 0:
            r.unit_s = self._ewma(r.unit_s, load.step_seconds / (load.running + self.policy.fixed_sequences))

    def first_token(
        self, replica: str, seconds: float, request_id: str = "", now: float | None = None
    ) -> None:
        r = self._rates(replica)
        r.first_token_s = self._ewma(r.first_token_s, seconds)
        if request_id in r.holding and now is not None:
            r.decoding[request_id] = (r.step_integral(now), now)

    def ended(
        self, replica: str, request_id: str, seconds: float | None, tokens: int = 0, now: float | None = None
    ) -> None:
        """The request left replica (finished, aborted, moved); seconds: sent -> end when it finished,
        tokens: those it generated there, now: the clock then. A finished request with a TPOT objective
        teaches tpot_bias: its TPOT over the mean step its replica reported meanwhile. What the gate
        projects is the scheduler's step; what a client sees also holds the scheduler's own work between
        steps and the stream (session 10, 2x the sustainable rate: the gate held the step to 180 ms and
        admitted requests' TPOT p50 was 212 ms)."""
        r = self._rates(replica)
        r.holding.pop(request_id, None)
        started = r.decoding.pop(request_id, None)
        finished = seconds is not None and now is not None and tokens >= 2
        if finished and started is not None and now > started[1]:
            mean_step = (r.step_integral(now) - started[0]) / (now - started[1])
            if mean_step > 0:
                self._tpot_ratios.append((now - started[1]) / (tokens - 1) / mean_step)
                tpot = quantile(self._tpot_ratios, self.policy.tpot_quantile)
                self.tpot_bias = min(4.0, max(0.5, tpot))
        if seconds is not None:
            r.service_s = self._ewma(r.service_s, seconds)

    def forget(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    # ---- the decisions ----

    def takes_decode(self, replica: str, load: ReplicaLoad | None, pending: int = 0) -> bool:
        """Whether replica may be offered a new request: its step, grown by the sequences it would add
        (those waiting there, the `pending` ones the router sent since its report, and this one), is
        within the tightest TPOT objective (times the margin) of the requests it holds. Counting what is
        on its way keeps a burst of admissions, all made on one report, from overshooting together."""
        rates = self._replicas.get(replica)
        if load is not None and load.step_seconds > 0 and rates is not None:
            rates.last_step = (load.step_seconds, load.running)
        if load is None or rates is None or not rates.holding:
            return True
        limit = self.policy.slo_tpot_margin * min(rates.holding.values())
        projected = self.projected_step(load, pending, rates.last_step)
        if rates.unit_s is not None:  # never below the recent reports' average
            sequences = load.running + load.waiting + pending + 1
            projected = max(projected, rates.unit_s * (sequences + self.policy.fixed_sequences))
        return projected * self.tpot_bias <= limit

    def projected_step(
        self, load: ReplicaLoad, pending: int = 0, last_step: tuple[float, int] | None = None
    ) -> float:
        """The replica's step once it runs what it holds and is sent, plus one more sequence: its recent
        step scaled by (sequences + fixed) / (running + fixed), a step costing about fixed_sequences'
        worth for the whole batch and one unit per sequence. A replica that reports no step (it was idle
        at its report) is projected from last_step, (seconds, running) of its last report that had one:
        counting it as free let everything the router held through on one report (session 10, a machine
        too slow for the objective: admitted requests' TPOT p50 414 ms against 200)."""
        fixed = self.policy.fixed_sequences
        step, running = (load.step_seconds, load.running) if load.step_seconds > 0 else last_step or (0.0, 0)
        sequences = load.running + load.waiting + pending + 1
        return step * (sequences + fixed) / (running + fixed)

    def predict_ttft(
        self, loads: dict[str, ReplicaLoad], ahead: int, free_slots: int
    ) -> tuple[float, float] | None:
        """(predicted TTFT, queue wait) in seconds for a request with `ahead` requests before it; None
        when nothing is measured yet. loads: the up replicas' last reports."""
        measured = [(t, self._replicas[t]) for t in loads if t in self._replicas]
        firsts = [r.first_token_s for _, r in measured if r.first_token_s is not None]
        rate = sum(_batch(loads[t]) / r.service_s for t, r in measured if r.service_s)
        if not firsts or rate <= 0:
            return None
        ahead += sum(load.waiting for load in loads.values())
        wait = max(0, ahead + 1 - free_slots) / rate
        return (wait + min(firsts)) * self.bias, wait * self.bias

    def check(
        self, objectives: Objectives, loads: dict[str, ReplicaLoad], ahead: int, free_slots: int
    ) -> float | None:
        """The request's predicted TTFT if queued now behind `ahead` requests (None: nothing measured yet,
        or no replica up: the pool's own wait-for-a-replica rule applies). Raises SloRefused when that
        exceeds its TTFT objective."""
        predicted = self.predict_ttft(loads, ahead, free_slots) if loads else None
        if objectives.ttft_s is None or predicted is None or predicted[0] <= objectives.ttft_s:
            return predicted and predicted[0]
        ttft, wait = predicted
        if wait == 0:
            # It would start at once: nothing is ahead of it and a replica has room. Refusing cannot serve
            # it sooner, and admitting it is how a prediction made stale by a slow spell (a start-up, a
            # neighbour) is corrected: refusing everything would leave it stale for ever. Admitted without
            # a prediction, so its TTFT does not teach the bias about a queue it never waited in.
            return None
        # Time until the queue has drained enough for the prediction to fit (at least the excess).
        retry = max(ttft - objectives.ttft_s, 0.001)
        raise SloRefused(
            f"cannot meet the TTFT objective: predicted {ttft * 1000:.0f} ms "
            f"({ahead} requests ahead, {wait * 1000:.0f} ms of queue) > {objectives.ttft_s * 1000:.0f} ms",
            math.ceil(retry),
        )


def record_slo(
    metrics, slo: tuple[Objectives, str], ttft: float, num_generated: int, decode_s: float
) -> None:
    """Met or missed, for a request with objectives: its TTFT and mean TPOT against them."""
    objectives, bucket = slo
    if not objectives.any:
        return
    tpot = decode_s / (num_generated - 1) if num_generated > 1 else 0.0
    met = (objectives.ttft_s is None or ttft <= objectives.ttft_s) and (
        objectives.tpot_s is None or tpot <= objectives.tpot_s
    )
    metrics.slo.labels(
        bucket=bucket, priority=str(objectives.priority), outcome="met" if met else "missed"
    ).inc()
