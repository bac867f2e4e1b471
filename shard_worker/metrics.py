"""A shard worker's Prometheus metrics: its forward pass, its all-reduce, its device memory."""

from __future__ import annotations

import resource

import torch
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import LATENCY_BUCKETS


class _DeviceCollector:
    """Device memory (and GPU utilisation through NVML when present), read at scrape time."""

    def __init__(self, device: torch.device, rank: int):
        self.device = device
        self.rank = str(rank)
        self._nvml = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            except Exception:  # NVML is optional: no library, no driver access
                self._nvml = None

    def collect(self):
        mem = GaugeMetricFamily(
            "tpserve_device_memory_used_bytes",
            "Memory this rank holds: CUDA allocator bytes, or the process's peak RSS on CPU.",
            labels=["rank", "device"],
        )
        if self.device.type == "cuda":
            used = torch.cuda.memory_reserved(self.device)
        else:
            used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        mem.add_metric([self.rank, str(self.device)], used)
        yield mem
        if self._nvml is not None:
            import pynvml

            util = GaugeMetricFamily(
                "tpserve_gpu_utilization_ratio",
                "GPU busy share over NVML's last sample period.",
                labels=["rank"],
            )
            util.add_metric([self.rank], pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu / 100.0)
            yield util


class _EncoderCacheCollector:
    """The vision encoder's runs and the encoder cache's hits (shard_worker/encoder_cache.py), read at
    scrape time from the counters the cache keeps."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        encodes = CounterMetricFamily(
            "tpserve_worker_image_encodes",
            "Images this rank's vision encoder encoded (an image found in the encoder cache is not).",
        )
        encodes.add_metric([], self.cache.encodes)
        yield encodes
        hits = CounterMetricFamily(
            "tpserve_worker_encoder_cache_hits",
            "Images whose encoder output this rank took from its encoder cache, by content hash.",
        )
        hits.add_metric([], self.cache.hits)
        yield hits
        held = GaugeMetricFamily(
            "tpserve_worker_encoder_cache_bytes", "Bytes of encoder outputs this rank's encoder cache holds."
        )
        held.add_metric([], self.cache.bytes)
        yield held


class WorkerMetrics:
    def __init__(self, device: torch.device, rank: int):
        r = self.registry = CollectorRegistry()
        self.forward = Histogram(
            "tpserve_worker_forward_duration_seconds",
            "This rank's forward pass per step (sampling included on rank 0).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.allreduce = Histogram(
            "tpserve_worker_allreduce_duration_seconds",
            "This rank's time in all-reduce and gather per step.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grammar_mask = Histogram(
            "tpserve_worker_grammar_mask_seconds",
            "Rank 0's host time per step on grammar masks (waiting for the fill that overlaps the forward, "
            "unpacking, applying), in steps that sample a sequence with a grammar.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grammar_fill = Histogram(
            "tpserve_worker_grammar_fill_seconds",
            "Rank 0's time per step filling grammar masks (llguidance), most of it while the forward runs.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.startup = Gauge(
            "tpserve_worker_startup_phase_seconds",
            "Seconds each phase of this rank's start-up took: load_weights, compile_kernels (CPU: the "
            "attention kernels compiled or loaded from the compile cache on a thread, beside "
            "load_weights), kv_sizing, warm_up (the steps a first request brings), kv_allocate. Set "
            "again when a scheduler reconnects (sizing, warm-up and allocation run again).",
            ["phase"],
            registry=r,
        )
        r.register(_DeviceCollector(device, rank))

    def watch_encoder_cache(self, cache) -> None:
        """Reports a vision model's encoder cache (ModelRunner.encoder_cache)."""
        self.registry.register(_EncoderCacheCollector(cache))
