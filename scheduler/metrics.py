"""The scheduler's Prometheus metrics. Queue and KV gauges are read at scrape time, not per step."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS


class _StateCollector:
    """Running/waiting counts and KV occupancy, read from the engine's snapshot when Prometheus scrapes."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        snap = self.engine.snapshot()
        running = waiting = swapped = used = total = queries = hits = cached = 0
        yield from _host_tier(snap)
        if snap is not None:
            running, waiting, swapped = snap.running, snap.waiting, snap.swapped
            total, used = snap.kv_blocks_total, snap.kv_blocks_total - snap.kv_blocks_free
            queries, hits, cached = (
                snap.prefix_cache_queries,
                snap.prefix_cache_hits,
                snap.prefix_cache_blocks,
            )
        yield GaugeMetricFamily(
            "tpserve_num_requests_running", "Sequences in the running batch.", value=running
        )
        yield GaugeMetricFamily(
            "tpserve_num_requests_waiting",
            "Sequences waiting in the scheduler for admission (not swapped out).",
            value=waiting,
        )
        yield GaugeMetricFamily(
            "tpserve_num_requests_swapped", "Preempted sequences swapped to host memory.", value=swapped
        )
        yield GaugeMetricFamily("tpserve_kv_blocks_total", "KV-cache blocks in the pool.", value=total)
        yield GaugeMetricFamily("tpserve_kv_blocks_used", "KV-cache blocks held by sequences.", value=used)
        yield CounterMetricFamily(
            "tpserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", value=queries
        )
        yield CounterMetricFamily(
            "tpserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", value=hits
        )
        yield GaugeMetricFamily(
            "tpserve_prefix_cache_blocks", "Blocks holding cached prefixes.", value=cached
        )
        yield GaugeMetricFamily(
            "tpserve_kv_usage_ratio",
            "Share of KV-cache blocks in use (0..1).",
            value=used / total if total else 0.0,
        )
        if self.engine.speculator is not None:
            yield from _speculation(self.engine.speculator.totals)


def _host_tier(snap):
    """The prefix cache's host tier (--host-prefix-cache), vLLM's prefix_cache_queries / _hits shape:
    the tokens the device's cache missed, looked up in host memory, and those found there."""
    for family, name, field, help_text in (
        (CounterMetricFamily, "host_prefix_cache_queries", "host_cache_queries",
         "Prompt tokens the device's prefix cache missed, looked up in the host tier."),
        (CounterMetricFamily, "host_prefix_cache_hits", "host_cache_hits",
         "Prompt tokens found in the host tier (copied back, not recomputed)."),
        (GaugeMetricFamily, "host_prefix_cache_blocks", "host_cache_blocks",
         "Host blocks holding cached prefixes."),
        (CounterMetricFamily, "kv_offloaded_blocks", "offloaded_blocks",
         "Prefix blocks evicted from the device and copied to the host tier."),
        (CounterMetricFamily, "kv_restored_blocks", "restored_blocks",
         "Host-tier blocks copied back to the device for a prompt."),
    ):  # fmt: skip
        yield family(f"tpserve_{name}", help_text, value=0 if snap is None else getattr(snap, field))


def _speculation(t):
    """Speculative decoding, with vLLM's names (spec_decode_*); only when it is configured."""
    for name, help_text, value in (
        ("num_drafts", "Verifications: sequence-steps that verified proposed tokens.", t.num_drafts),
        ("num_draft_tokens", "Proposed tokens verified.", t.num_draft_tokens),
        ("num_accepted_tokens", "Proposed tokens accepted.", t.num_accepted_tokens),
        (
            "num_emitted_tokens",
            "Tokens verifications produced: accepted ones and one more each.",
            t.num_emitted_tokens,
        ),
    ):
        yield CounterMetricFamily(f"tpserve_spec_decode_{name}", help_text, value=value)
    per_pos = CounterMetricFamily(
        "tpserve_spec_decode_num_accepted_tokens_per_pos",
        "Verifications that accepted the proposal at this position (0-based).",
        labels=["position"],
    )
    for i, value in enumerate(t.accepted_per_position):
        per_pos.add_metric([str(i)], value)
    yield per_pos
    yield GaugeMetricFamily(
        "tpserve_spec_decode_draft_acceptance_rate",
        "Share of proposed tokens accepted since start.",
        value=t.acceptance_rate,
    )
    yield GaugeMetricFamily(
        "tpserve_spec_decode_mean_accepted_length",
        "Tokens per verification since start, the target model's own one included.",
        value=t.mean_accepted_length,
    )


class SchedulerMetrics:
    def __init__(self, engine):
        r = self.registry = CollectorRegistry()
        self.queue_time = Histogram(
            "tpserve_queue_time_seconds",
            "Time from arrival at the scheduler to the request's first step.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "tpserve_step_duration_seconds",
            "Scheduler wall time per iteration: plan, send to ranks, forward, apply results.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forward_duration = Histogram(
            "tpserve_forward_duration_seconds",
            "Slowest rank's forward pass (sampling included) per iteration.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.allreduce_duration = Histogram(
            "tpserve_allreduce_duration_seconds",
            "Slowest rank's time in all-reduce and gather per iteration.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "tpserve_batch_size", "Sequences per iteration.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "tpserve_batch_tokens", "Tokens computed per iteration.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.preemptions = Counter(
            "tpserve_preemptions", "Running sequences preempted, by kind.", ["kind"], registry=r
        )
        self.fallback_switches = Counter(
            "tpserve_static_fallback_switches",
            "Switches of the static fallback, by the mode switched to and the reason.",
            ["to", "reason"],
            registry=r,
        )
        r.register(_StateCollector(engine))
