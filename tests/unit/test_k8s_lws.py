"""The LeaderWorkerSet overlay (each model replica one group: leader = scheduler, workers = ranks) and the
autoscaler that adds whole groups from the schedulers' KV usage."""

from __future__ import annotations

import copy
import subprocess

import yaml

from tests.unit.k8s_commands import _expand, _groups, _of, _stub_path, processes
from tests.unit.k8s_metrics import (
    ADAPTER_VALUES,
    _scrape_target_labels,
    metric_names_by_process,  # noqa: F401 (a fixture)
    promql_metric_names,
)
from tests.unit.k8s_render import (
    LWS,
    LWS_GROUPS,
    _by_kind,
    _crd_version,
    _labels,
    _lws_crd,
    _lws_templates,
    _named,
    render,
)

# ---------------------------------------------------------------- the LeaderWorkerSet replica group


def test_lws_group_is_one_replica_whose_ranks_take_their_index_and_leader_from_the_lws():
    """One group = one replica: its leader is the scheduler and its workers are the ranks, size - 1 =
    --world-size = the scheduler's --worker flags; a worker's rank is LWS_WORKER_INDEX - 1 and its
    rendezvous is worker 1 of its own leader (the leader-name annotation), in every group."""
    key = ("overlays/lws", ())
    (lws,) = _by_kind(render(*key), "LeaderWorkerSet")
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    groups = _groups(key)
    assert len(groups) == LWS_GROUPS
    for scheduler, ranks in groups:
        group = _labels(scheduler.pod)[LWS + "group-index"]
        assert scheduler.owner == ("LeaderWorkerSet", lws["metadata"]["name"])
        assert scheduler.env["LWS_WORKER_INDEX"] == "0", "the leader is the scheduler"
        assert len(ranks) == size - 1 == len(scheduler.config.workers)
        for worker in ranks:
            assert _labels(worker.pod)[LWS + "group-index"] == group, f"{worker.name} is another group's"
            assert worker.config.rank == int(worker.env["LWS_WORKER_INDEX"]) - 1
            assert worker.config.world_size == int(worker.env["LWS_GROUP_SIZE"]) - 1
            assert worker.pod["metadata"]["annotations"][LWS + "leader-name"] == scheduler.name
        # Every rank of the group, none missing: the group's pods are exactly its scheduler and ranks.
        members = [p.name for p in processes(key) if _labels(p.pod).get(LWS + "group-index") == group]
        assert sorted(members) == sorted([scheduler.name, *(w.name for w in ranks)])


def test_lws_worker_will_not_start_without_the_index_the_lws_gives_it():
    """The rank comes from the LWS alone: a worker without LWS_WORKER_INDEX (no LWS webhook) stops with
    a message instead of starting as some rank."""
    key = ("overlays/lws", ())
    worker = _of(processes(key), "shard-worker")[0]
    command = [*worker.container["command"], *worker.container["args"]]
    env = {k: v for k, v in worker.env.items() if k != "LWS_WORKER_INDEX"}
    argv = [_expand(a, env, worker.name) for a in command]
    out = subprocess.run(["sh", *argv[1:]], env={**env, "PATH": _stub_path()}, capture_output=True, text=True)
    assert out.returncode != 0 and "LWS_WORKER_INDEX" in out.stderr and not out.stdout


def test_lws_templates_are_the_base_replica_but_for_what_the_lws_provides():
    """The leader and worker templates are copies of the base's scheduler Deployment and shard
    StatefulSet pods: only the replica label, the --worker/--rank/--dist-init flags (named from what the
    LWS provides), the rank's shell wrapper, its placement term and its liveness differ. A change to the
    base must reach k8s/overlays/lws/leaderworkerset.yaml too."""
    base = render("base")
    (lws,) = _by_kind(render("overlays/lws"), "LeaderWorkerSet")
    templates = _lws_templates(lws)
    pairs = [
        (_named(base, "Deployment", "tpserve-scheduler")["spec"]["template"], templates["leader"]),
        (_named(base, "StatefulSet", "tpserve-shard")["spec"]["template"], templates["worker"]),
    ]
    for base_template, lws_template in pairs:
        a, b = copy.deepcopy(base_template), copy.deepcopy(lws_template)
        del a["metadata"]["labels"]["tpserve.io/replica"]
        for t in (a, b):
            (container,) = t["spec"]["containers"]
            container["args"] = [
                x for x in container["args"] if not x.startswith(("--worker=", "--rank=", "--dist-init="))
            ]
            dropped = ("POD_INDEX", "LEADER_NAME", "POD_DNS_NAME")
            container["env"] = [e for e in container["env"] if e["name"] not in dropped]
            if container["name"] == "shard-worker":
                for field in ("command", "livenessProbe"):
                    container.pop(field)
                t["spec"].pop("affinity")
        assert a == b, f"{a['spec']['containers'][0]['name']}: the LWS template drifted from the base's"


# ---------------------------------------------------------------- autoscaling


def test_autoscaler_adds_whole_replicas_from_the_schedulers_kv_usage_at_80_percent(
    metric_names_by_process,  # noqa: F811 (the fixture)
):
    objects = render("autoscaling")
    (hpa,) = _by_kind(objects, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    (lws,) = [
        o
        for o in objects
        if (o["apiVersion"], o["kind"], o["metadata"]["name"])
        == (ref["apiVersion"], ref["kind"], ref["name"])
    ]
    assert lws["kind"] == "LeaderWorkerSet", "one replica = one group: the HPA adds and removes groups"
    # The CRD's scale subresource gives the HPA the LWS's replicas and, as its pods, the leaders
    # (status.hpaPodSelector); the leaders are the schedulers, which export the metric.
    scale = _crd_version(_lws_crd())["subresources"]["scale"]
    assert (
        scale["specReplicasPath"] == ".spec.replicas"
        and scale["labelSelectorPath"] == ".status.hpaPodSelector"
    )
    assert _lws_templates(lws)["leader"]["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"
    assert "replicas" not in lws["spec"], "the HPA owns the replicas: an apply must not reset them"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "tpserve_kv_usage_ratio"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    # Every metric the HPA asks for is one the adapter's rules serve, per pod, from the scheduler's series.
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]
    assert set(rules) == {"default", "custom"} and rules["default"] is False
    served = {r["name"]["as"] for r in rules["custom"]}
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served
    for rule in rules["custom"]:
        for query in (rule["seriesQuery"], rule["metricsQuery"].replace("<<.Series>>", rule["name"]["as"])):
            assert promql_metric_names(query) == {rule["name"]["as"]}, query
        assert rule["name"]["as"] in metric_names_by_process["scheduler"], (
            f"the scheduler lacks {rule['name']['as']}"
        )
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"] == {"resource": "pod"} and overrides["namespace"] == {"resource": "namespace"}
        assert set(overrides) <= _scrape_target_labels()
