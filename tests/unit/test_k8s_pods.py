"""What runs in the pods: metrics and logs, the knobs, GPUs and node placement, the model volume, and the
overlays that add replicas or ranks (rendered as test_k8s.py's docstring says)."""

from __future__ import annotations

import json
import re

import pytest

from tests.unit.k8s_commands import Process, _groups, _of, processes
from tests.unit.k8s_metrics import _pod_discovery_labels, _scrape_job
from tests.unit.k8s_render import (
    LWS,
    RENDERS,
    SEED_KNOBS,
    _by_kind,
    _labels,
    _named,
    _render_id,
    _selects,
    _template_labels,
    render,
)


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_every_process_serves_metrics_where_prometheus_looks_and_logs_json(key):
    objects = render(*key)
    (configmap,) = _by_kind(objects, "ConfigMap")
    keep_rules = [r for r in _scrape_job()["relabel_configs"] if r.get("action") == "keep"]
    for p in processes(key):
        named = {port.get("name"): port["containerPort"] for port in p.container["ports"]}
        assert p.config.metrics_port is not None and p.config.metrics_port != p.config.port, p.name
        assert named.get("metrics") == p.config.metrics_port, (
            f"{p.name}: no containerPort `metrics` for /metrics"
        )
        annotations = p.pod["metadata"]["annotations"]
        assert annotations.get("prometheus.io/scrape") == "true", p.name
        assert annotations.get("prometheus.io/port") == str(p.config.metrics_port), p.name
        assert annotations.get("prometheus.io/path") == "/metrics", p.name
        # The scrape job in k8s/prometheus keeps this pod's metrics port and drops its other ports.
        for port_name in named:
            meta = _pod_discovery_labels(p.pod, port_name)
            values = [";".join(meta.get(label, "") for label in r["source_labels"]) for r in keep_rules]
            kept = all(re.fullmatch(r["regex"], v) for r, v in zip(keep_rules, values, strict=True))
            assert kept == (port_name == "metrics"), f"{p.name}: scrape job and port {port_name}"
        assert p.ns.log_format == "json", f"{p.name}: one JSON object a line, for the cluster's log pipeline"
        assert p.config.tracing.exporter == configmap["data"]["TPSERVE_TRACE_EXPORTER"], p.name
        assert p.config.tracing.otlp_endpoint == configmap["data"]["TPSERVE_OTLP_ENDPOINT"], p.name


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_configmap_holds_the_seed_knobs_and_each_is_used(key):
    objects = render(*key)
    (configmap,) = _by_kind(objects, "ConfigMap")
    data = configmap["data"]
    assert SEED_KNOBS.items() <= data.items()
    procs = processes(key)
    used = {
        var["valueFrom"]["configMapKeyRef"]["key"]
        for p in procs
        for var in p.container.get("env", [])
        if "configMapKeyRef" in var.get("valueFrom", {})
    }
    assert set(data) == used, "a ConfigMap key no container reads"
    # What reaches every scheduler is what the ConfigMap says.
    for p in _of(procs, "scheduler"):
        assert p.config.policy.max_num_seqs == int(data["TPSERVE_MAX_NUM_SEQS"])
        assert p.config.block_size == int(data["TPSERVE_BLOCK_SIZE"])
        assert p.config.swap_space == float(data["TPSERVE_SWAP_SPACE_GIB"])
        assert p.config.gpu_memory_utilization == float(data["TPSERVE_GPU_MEMORY_UTILIZATION"])


def _replica(p: Process) -> tuple:
    """Which model replica a pod is part of: its workload, and its group in a LeaderWorkerSet."""
    return (*p.owner, _labels(p.pod).get(LWS + "group-index"))


def _affinity_selects(term: dict, pod: dict, other: dict) -> bool:
    """Whether a required pod-affinity term of pod's spec selects other: its labelSelector, with
    matchLabelKeys turned into `key In (pod's value)` as the API server does when it admits pod."""
    labels = _labels(other)
    if not _selects(term["labelSelector"].get("matchLabels", {}), labels):
        return False
    return all(k in labels and labels[k] == _labels(pod).get(k) for k in term.get("matchLabelKeys", []))


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_gpus_only_where_the_device_is_cuda_and_a_replica_s_ranks_share_a_node(key):
    procs = processes(key)
    workers = _of(procs, "shard-worker")
    for p in procs:
        resources = p.container["resources"]
        assert resources["requests"].get("cpu") and resources["requests"].get("memory"), p.name
        assert resources["limits"].get("memory"), p.name
        gpus = {k: v.get("nvidia.com/gpu") for k, v in resources.items()}
        if p.component == "shard-worker" and p.config.device == "cuda":
            assert gpus == {"requests": "1", "limits": "1"}  # one device per rank
        else:
            assert gpus == {"requests": None, "limits": None}, p.name
    for w in workers:
        if w.config.device != "cuda":
            assert w.config.dtype == "float32"
            continue
        volumes = {v["name"]: v for v in w.pod["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        (term,) = w.pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"  # every rank on one node...
        held = [o.name for o in workers if _affinity_selects(term, w.pod, o.pod)]
        # ...with its own replica's ranks, and no other replica's (those may go to other nodes).
        assert held == [o.name for o in workers if _replica(o) == _replica(w)], w.name


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_model_is_mounted_read_only_where_it_is_read(key):
    for p in processes(key):
        if p.component == "scheduler":
            continue
        (mount,) = [m for m in p.container["volumeMounts"] if m["mountPath"] == p.ns.model]
        assert mount["readOnly"] is True
        volume = next(v for v in p.pod["spec"]["volumes"] if v["name"] == mount["name"])
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            assert claim in {c["metadata"]["name"] for c in _by_kind(render(*key), "PersistentVolumeClaim")}
        else:  # built in the pod by an init container
            assert any(
                m["name"] == mount["name"] and not m.get("readOnly")
                for init in p.pod["spec"]["initContainers"]
                for m in init["volumeMounts"]
            )


def test_replicas2_overlay_is_two_identical_replicas_found_through_one_headless_service():
    key = ("overlays/replicas2", ())
    objects = render(*key)
    groups = _groups(key)
    assert len(groups) == 2
    labels = sorted(
        (_labels(s.pod)["tpserve.io/replica"], *{_labels(w.pod)["tpserve.io/replica"] for w in ranks})
        for s, ranks in groups
    )
    assert labels == [("0", "0"), ("1", "1")]
    # Cache-aware routing has prefixes to go by, with the host tier behind the device's.
    assert all(s.config.enable_prefix_caching and s.config.host_prefix_cache for s, _ in groups)
    # No workload's selector takes another replica's pods (a StatefulSet or Deployment fighting over pods).
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    for w in workloads:
        selector = w["spec"]["selector"]["matchLabels"]
        assert [o for o in workloads if _selects(selector, _template_labels(o))] == [w], w["metadata"]["name"]
    # Replica 1 is replica 0 renamed, nothing else: a base change must reach replica-1.yaml too.
    s0, s1 = (_named(objects, "StatefulSet", n) for n in ("tpserve-shard", "tpserve-shard-r1"))
    d0, d1 = (_named(objects, "Deployment", n) for n in ("tpserve-scheduler", "tpserve-scheduler-r1"))
    v0, v1 = (_named(objects, "Service", n) for n in ("tpserve-shard", "tpserve-shard-r1"))

    def renamed(obj):
        text = json.dumps(obj).replace("tpserve-shard", "tpserve-shard-r1").replace('"0"', '"1"')
        return json.loads(text.replace('"tpserve-scheduler"', '"tpserve-scheduler-r1"'))

    assert renamed(s0) == s1 and renamed(d0) == d1 and renamed(v0) == v1


def test_tp8_overlay_is_one_replica_of_eight_ranks():
    ((scheduler, ranks),) = _groups(("overlays/tp8", ()))
    assert len(ranks) == 8 and len(scheduler.config.workers) == 8
