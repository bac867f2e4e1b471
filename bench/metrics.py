"""Per-request timings and the per-run summary, with vLLM benchmark_serving's definitions.

- TTFT: first token's arrival minus the request's send time.
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with more than one output token.
- ITL: every gap between successive token-carrying messages (tokens delivered together count as one gap).
- Goodput: requests per second that finished without error and met every SLO given (a request with a
  single output token has no TPOT and meets any TPOT SLO).

Pure arithmetic on timestamps: no gRPC, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The keys of one run object in the results JSON, in order. Stable: other tools read them.
RUN_KEYS = (
    "name",
    "workload",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "goodput_rps",
    "peak_rss_mb",
    "mean_batch_size",
)
STAT_KEYS = ("mean", "p50", "p90", "p99")


@dataclass
class RequestResult:
    """What one request's client saw. Times are time.perf_counter() seconds."""

    prompt_tokens: int
    send_time: float
    # One entry per message that carried tokens: (arrival time, number of tokens in it).
    chunks: list[tuple[float, int]] = field(default_factory=list)
    end_time: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None and bool(self.chunks)

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft_s(self) -> float:
        return self.chunks[0][0] - self.send_time

    @property
    def e2e_s(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None

    @property
    def itl_s(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in milliseconds (linear interpolation, numpy's default); all None when empty."""
    if not values_s:
        return dict.fromkeys(STAT_KEYS)
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.ok:
        return False
    if slo_ttft_ms is not None and r.ttft_s * 1000.0 > slo_ttft_ms:
        return False
    tpot = r.tpot_s
    return not (slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms)


def run_duration_s(results: list[RequestResult]) -> float:
    """From the first send to the last completion: what throughput is divided by."""
    ends = [r.end_time for r in results if r.end_time is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.send_time for r in results)


def summarize(
    name: str,
    workload: str,
    results: list[RequestResult],
    *,
    duration_s: float | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    peak_rss_mb: dict[str, float] | None = None,
    mean_batch_size: float | None = None,
) -> dict:
    """One run object with exactly RUN_KEYS. goodput_rps is None when no SLO is given."""
    duration = run_duration_s(results) if duration_s is None else duration_s
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    goodput = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        goodput = per_s(sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results))
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    return {
        "name": name,
        "workload": workload,
        "output_tokens_per_s": per_s(out_tokens),
        "requests_per_s": per_s(len(done)),
        "ttft_ms": stats_ms([r.ttft_s for r in done]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([g for r in done for g in r.itl_s]),
        "e2e_ms": stats_ms([r.e2e_s for r in done]),
        "goodput_rps": goodput,
        "peak_rss_mb": peak_rss_mb or {},
        "mean_batch_size": mean_batch_size,
    }


def details(results: list[RequestResult], expected_output_tokens: list[int] | None = None) -> dict:
    """Counts and errors that sit beside a run object (not in it, so the run schema stays fixed)."""
    done = [r for r in results if r.ok]
    errors = sorted({r.error for r in results if r.error is not None})
    d = {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_output_tokens": sum(r.output_tokens for r in done),
        "duration_s": run_duration_s(results),
        "errors": errors[:10],
    }
    if expected_output_tokens is not None:
        # ignore_eos makes output lengths exact; a mismatch means the system under test cut a request short.
        d["length_mismatches"] = sum(
            r.ok and r.output_tokens != want for r, want in zip(results, expected_output_tokens, strict=True)
        )
    return d


def engine_overhead_pct(step_wall_s: float | None, forward_s: float | None) -> float | None:
    """Share of the engine's step time not spent in the forward pass (scheduling, gRPC, applying results),
    from the server's step counters; None when there were no steps to measure."""
    if not step_wall_s or forward_s is None:
        return None
    return max(0.0, 100.0 * (step_wall_s - forward_s) / step_wall_s)


def latency_samples_ms(results: list[RequestResult]) -> dict[str, list[float]]:
    """Raw per-request TTFT / TPOT / e2e in ms, for CDF plots."""
    done = [r for r in results if r.ok]
    return {
        "ttft": [r.ttft_s * 1000.0 for r in done],
        "tpot": [t * 1000.0 for t in (r.tpot_s for r in done) if t is not None],
        "e2e": [r.e2e_s * 1000.0 for r in done],
    }
