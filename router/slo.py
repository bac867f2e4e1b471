"""Latency objectives: what each request is promised, whether the router can keep the promise, and which
replicas may take more decode load. Plain Python: no gRPC, no asyncio; the clock is an argument.

What a request is promised and may ask is router/objectives.py's.

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
- Before requests have measured a replica, both come from the speed its workers measured at start-up
  (common/speed.py: a prefill rate and the decode step per batch size): first_token_s is a request's
  prefill and one step, service_s that and max_new_tokens steps at the batch the replica holds, every
  request sent there counted from the moment it was sent. So a fresh replica hit by a burst refuses at
  once what it cannot serve in time. Without a speed (a worker that does not measure) nothing is
  predicted until a request has finished, and requests are admitted.
- A request that would start at once (nothing ahead, a replica with room that takes decode load) is
  admitted whatever first_token_s says: refusing it cannot serve it sooner, and only admitted requests
  refresh first_token_s (a slow spell measured once would otherwise refuse every later request).
- The model is crude (credit round trips, the router's own loop and other processes on the host slow the
  drain), so the prediction is scaled by `bias`: a high quantile (`ttft_quantile`, 0.97; within [0.5, 4]) of
  the recent ratios (the last `window`, 64) of each request's actual TTFT at the router to what the
  model predicted for it, uncorrected, when it arrived (measured against the corrected prediction, the
  ratio was the error left after the last correction, and taking it as the next factor sawed between
  right and too low). A quantile rather than a mean, because the promise is each request's:
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
finished request's TPOT (or one still decoding, every 8 tokens: a fresh replica learns it from its first
requests) to the mean step its replica reported while it decoded: the scheduler's own work
between steps and the stream are in what clients see, not in the step. And it is never below what the
recent reports' average (an EWMA of the step per sequence) projects: with a queue always waiting, every
report that happened to be fast was taken at once, so admissions followed the step's lucky dips (session
10, 3x: TPOT p50 200 ms with the gate at 180). Before any report has a step, the measured speed projects
it. A TPOT objective that no replica's step can meet even alone holds no replica closed: waiting for the
batch to drain would not meet it, and every other request would wait (a client asking 1 ms once made six
ordinary requests wait 30 s). A client that asks for one is refused (`infeasible_tpot`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from common.load import ReplicaLoad
from common.speed import StackSpeed
from router.objectives import (  # noqa: F401 (re-exported: what the router's other modules import)
    NO_OBJECTIVES,
    NotAllowed,
    Objectives,
    SloPolicy,
    below_floor,
    resolve,
    ttft_budget_ms,
)


def quantile(values, q: float) -> float:
    """The q-quantile of values (not empty), the nearest rank above: of 64 ratios, q 0.97 is the 63rd."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _batch(load: ReplicaLoad, sent: int = 0) -> int:
    """The sequences a replica serves at once now: its running batch (which the TPOT gate or its memory
    may hold well under max_num_seqs), or while it runs none the `sent` requests on their way, at least
    1."""
    return max(1, min(load.max_num_seqs, load.running or sent))


# A client's TPOT objective is refused when the fastest replica's step alone is this many times past it.
INFEASIBLE_BY = 2.0


class TpotInfeasible(NotAllowed):
    """The client's TPOT objective is tighter than any replica's step alone: refused (INVALID_ARGUMENT)."""

    def __init__(self, message: str):
        super().__init__("tpot_objective_ms", message)


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
    speed: StackSpeed = StackSpeed()  # what its workers measured at start-up (not known: none)
    sent: set[str] = field(default_factory=set)  # requests sent there and not ended
    max_num_seqs: int | None = None  # its cap on the batch, from its reports
    # EWMAs over the requests sent of what the speed predicts (first token, end): first_token_s and
    # service_s until those are measured.
    prior_first_s: float | None = None
    prior_service_s: float | None = None

    def first_s(self) -> float | None:
        return self.first_token_s if self.first_token_s is not None else self.prior_first_s

    def end_s(self) -> float | None:
        return self.service_s if self.service_s is not None else self.prior_service_s

    def fastest_step(self, fixed_sequences: float) -> float | None:
        """Its step with one sequence: from its reports once they have steps (fresher), else as its
        workers measured it at start-up."""
        if self.unit_s is not None:
            return self.unit_s * (1 + fixed_sequences)
        return self.speed.step_seconds(1) if self.speed.known else None

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
        """A request's TTFT at the router, and what `check` returned when it arrived: the model's
        prediction before the bias, so the bias is the ratio itself, not a correction of the last one."""
        if predicted_s > 0:
            self._ratios.append(actual_s / predicted_s)
            self.bias = min(4.0, max(0.5, quantile(self._ratios, self.policy.ttft_quantile)))

    def _rates(self, replica: str) -> _Rates:
        return self._replicas.setdefault(replica, _Rates())

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.policy.alpha * (new - old)

    # ---- what the router measures ----

    def speed(self, replica: str, speed: StackSpeed) -> None:
        """What replica's workers measured at start-up (sent with its model's description)."""
        self._rates(replica).speed = speed

    def sent(
        self,
        replica: str,
        request_id: str,
        objectives: Objectives,
        prompt_tokens: int = 0,
        max_new_tokens: int = 0,
    ) -> None:
        """A request left the queue for replica: its work counts there from now (the batch it will run
        in, and what the speed says its first token and its end will take)."""
        r = self._rates(replica)
        if objectives.tpot_s is not None and not self._infeasible(r, objectives.tpot_s):
            r.holding[request_id] = objectives.tpot_s  # an infeasible one holds nothing closed: demoted
        r.sent.add(request_id)
        if r.speed.known:
            step = r.speed.step_seconds(min(len(r.sent), r.max_num_seqs or len(r.sent)))
            first = r.speed.prefill_seconds(prompt_tokens) + step
            r.prior_first_s = self._ewma(r.prior_first_s, first)
            r.prior_service_s = self._ewma(r.prior_service_s, first + max(0, max_new_tokens - 1) * step)

    def _infeasible(self, r: _Rates, tpot_s: float, factor: float = 1.0) -> bool:
        """Whether a TPOT objective is beyond r's step alone (times the margin and tpot_bias), by more
        than `factor`."""
        fastest = r.fastest_step(self.policy.fixed_sequences)
        limit = self.policy.slo_tpot_margin * tpot_s * factor
        return fastest is not None and fastest * self.tpot_bias > limit

    def infeasible_tpot(self, objectives: Objectives, replicas) -> None:
        """Raises TpotInfeasible when the client asked a TPOT objective that none of `replicas` (the up
        ones) can meet even with nothing else in its batch, by more than INFEASIBLE_BY: a step measured
        once (a start-up on a busy host: SmolLM2's at 150 ms beside other stacks) is not trusted to
        refuse an objective near it, which is served, demoted (`sent`). The server's default never is."""
        rates = [self._replicas[t] for t in replicas if t in self._replicas]
        tpot = objectives.tpot_s
        if (
            not objectives.tpot_asked
            or tpot is None
            or not rates
            or not all(self._infeasible(r, tpot, INFEASIBLE_BY) for r in rates)
        ):
            return
        fastest = min(r.fastest_step(self.policy.fixed_sequences) for r in rates)
        raise TpotInfeasible(
            f"tpot_objective_ms {round(tpot * 1000)} cannot be met: the fastest replica's decode step alone "
            f"takes {fastest * 1000:.0f} ms (x{self.tpot_bias:.2f} measured overhead, "
            f"--slo-tpot-margin {self.policy.slo_tpot_margin})"
        )

    def reported(self, replica: str, load: ReplicaLoad, now: float) -> None:
        """A load report from replica: its step time, integrated for the TPOT its requests see."""
        r = self._rates(replica)
        r.max_num_seqs = load.max_num_seqs
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
        r.sent.discard(request_id)
        started = r.decoding.pop(request_id, None)
        if seconds is not None and now is not None and started is not None:
            self._learn_tpot(r, started, tokens, now)
        if seconds is not None:
            r.service_s = self._ewma(r.service_s, seconds)

    def progressed(self, replica: str, request_id: str, tokens: int, now: float) -> None:
        """A request still decoding on replica has generated `tokens` there: its TPOT so far teaches
        tpot_bias as a finished one's does, so that a fresh replica learns what its stack adds to the
        step from its first requests, not once they end (a burst is over by then)."""
        r = self._rates(replica)
        started = r.decoding.get(request_id)
        if started is not None:
            self._learn_tpot(r, started, tokens, now)

    def _learn_tpot(self, r: _Rates, started: tuple[float, float], tokens: int, now: float) -> None:
        """The ratio of a request's TPOT since its first token to the mean step its replica reported."""
        if tokens < 2 or now <= started[1]:
            return
        mean_step = (r.step_integral(now) - started[0]) / (now - started[1])
        if mean_step > 0:
            self._tpot_ratios.append((now - started[1]) / (tokens - 1) / mean_step)
            tpot = quantile(self._tpot_ratios, self.policy.tpot_quantile)
            self.tpot_bias = min(4.0, max(0.5, tpot))

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
        sequences = load.running + load.waiting + pending + 1
        if rates.unit_s is not None:  # never below the recent reports' average
            projected = max(projected, rates.unit_s * (sequences + self.policy.fixed_sequences))
        elif rates.speed.known:  # no step reported yet: what the workers measured
            projected = max(projected, rates.speed.step_seconds(sequences))
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
        """(predicted TTFT, queue wait) in seconds for a request with `ahead` requests before it, scaled
        by the bias; None when nothing is measured yet. loads: the up replicas' last reports."""
        raw = self._model_ttft(loads, ahead, free_slots)
        return None if raw is None else (raw[0] * self.bias, raw[1] * self.bias)

    def _model_ttft(
        self, loads: dict[str, ReplicaLoad], ahead: int, free_slots: int
    ) -> tuple[float, float] | None:
        """predict_ttft before the bias. A replica's batch: its running one, or while it reports none
        (fresh) the requests sent there."""
        measured = [(t, self._replicas[t]) for t in loads if t in self._replicas]
        firsts = [r.first_s() for _, r in measured if r.first_s() is not None]
        rate = sum(_batch(loads[t], len(r.sent)) / r.end_s() for t, r in measured if r.end_s())
        if not firsts or rate <= 0:
            return None
        ahead += sum(load.waiting for load in loads.values())
        wait = max(0, ahead + 1 - free_slots) / rate
        return wait + min(firsts), wait

    def check(
        self, objectives: Objectives, loads: dict[str, ReplicaLoad], ahead: int, free_slots: int
    ) -> float | None:
        """The request's TTFT as the model predicts it before the bias, for observed_ttft (None: nothing
        measured yet, or no replica up: the pool's own wait-for-a-replica rule applies). Raises
        SloRefused when the prediction, scaled by the bias, exceeds its TTFT objective."""
        raw = self._model_ttft(loads, ahead, free_slots) if loads else None
        predicted = None if raw is None else (raw[0] * self.bias, raw[1] * self.bias)
        if objectives.ttft_s is None or predicted is None or predicted[0] <= objectives.ttft_s:
            return raw and raw[0]
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
