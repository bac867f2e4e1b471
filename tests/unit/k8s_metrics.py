"""The metric names the processes export (from their real registries), and those PromQL expressions and
Prometheus' pod discovery read."""

from __future__ import annotations

import re
import sys
import types

import pytest
import yaml

from tests.unit.k8s_render import K8S

# ---------------------------------------------------------------- metrics, scraping, PromQL

SCRAPE_CONFIG = K8S / "prometheus" / "scrape-config.yaml"
DASHBOARD = K8S / "grafana" / "tpserve-dashboard.json"
ADAPTER_VALUES = K8S / "autoscaling" / "prometheus-adapter-values.yaml"
# What each metric family type puts on the wire after its name (prometheus_client's exposition).
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
PROMQL_WORDS |= {"offset", "inf", "nan"}


@pytest.fixture(scope="module")
def metric_names_by_process() -> dict[str, frozenset[str]]:
    """Every series name the router, the scheduler and a shard worker can expose, from their real
    registries (metric families with no sample yet, such as labelled counters, count by their type)."""
    import torch

    from router.metrics import RouterMetrics
    from scheduler.metrics import SchedulerMetrics
    from scheduler.speculation import SpeculativePolicy, Speculator
    from shard_worker import metrics as worker_metrics

    # What the scheduler's gauges read before start; with speculation on, so its series count too.
    no_engine = types.SimpleNamespace(
        snapshot=lambda: None, speculator=Speculator(SpeculativePolicy(speculative_method="ngram"))
    )
    families = {
        "router": list(RouterMetrics().registry.collect()),
        "scheduler": list(SchedulerMetrics(no_engine).registry.collect()),
        "shard-worker": list(worker_metrics.WorkerMetrics(torch.device("cpu"), 0).registry.collect()),
    }
    # GPU utilisation is collected only on CUDA with NVML: collect it once with NVML stood in.
    collector = worker_metrics._DeviceCollector(torch.device("cpu"), 0)
    collector._nvml = object()
    nvml = types.SimpleNamespace(nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=50))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "pynvml", nvml)
        families["shard-worker"] += list(collector.collect())
    by_process = {}
    for process, found in families.items():
        names = set()
        for family in found:
            names |= {sample.name for sample in family.samples}
            names |= {family.name + suffix for suffix in SAMPLE_SUFFIXES.get(family.type, ("",))}
        by_process[process] = frozenset(names)
    assert "tpserve_gpu_utilization_ratio" in by_process["shard-worker"]
    assert "tpserve_generation_tokens_total" in by_process["router"]
    return by_process


@pytest.fixture(scope="module")
def exported_metric_names(metric_names_by_process) -> frozenset[str]:
    return frozenset().union(*metric_names_by_process.values())


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers outside strings, label matchers, ranges
    and grouping clauses that are not called as functions and are not keywords."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)(\s*\()?", s):
        if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def _scrape_job() -> dict:
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
    return job


def _scrape_target_labels() -> set[str]:
    return {r["target_label"] for r in _scrape_job()["relabel_configs"] if "target_label" in r}


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _pod_discovery_labels(pod: dict, port_name: str) -> dict[str, str]:
    """The __meta_kubernetes_pod_* labels Prometheus' pod discovery gives this pod's port."""
    meta = pod["metadata"]
    out = {"__meta_kubernetes_pod_container_port_name": port_name}
    for key, value in meta.get("labels", {}).items():
        out[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = value
    for key, value in meta.get("annotations", {}).items():
        out[f"__meta_kubernetes_pod_annotation_{_sanitize(key)}"] = value
    return out
