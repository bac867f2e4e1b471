"""What the k8s tests read: the kustomizations rendered by the real kubectl, and the pods, Services and
DNS names the controllers would make of them (tests/unit/test_k8s*.py; see test_k8s.py's docstring)."""

from __future__ import annotations

import atexit
import copy
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router import config as router_config
from scheduler import config as scheduler_config
from shard_worker import config as worker_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
DOCS = sorted((ROOT / "docs").rglob("*.md"))  # the pages that show the commands and manifests
KUBECTL = Path(sys.executable).with_name("kubectl")
LWS_CRD = ROOT / "tests" / "data" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def _kustomization(directory: str) -> dict:
    return yaml.safe_load((K8S / directory / "kustomization.yaml").read_text())


_DIRS = sorted(p.parent.relative_to(K8S).as_posix() for p in K8S.rglob("kustomization.yaml"))
KUSTOMIZATIONS = [d for d in _DIRS if _kustomization(d).get("kind", "Kustomization") == "Kustomization"]
COMPONENTS = tuple(d for d in _DIRS if _kustomization(d).get("kind") == "Component")
# What is rendered: every kustomization as it is, and every one that does not list the security
# components (k8s/components) with all of them added, since they must compose with any overlay.
RENDERS = [(d, ()) for d in KUSTOMIZATIONS] + [
    (d, COMPONENTS) for d in KUSTOMIZATIONS if not _kustomization(d).get("components")
]
SECURED = [r for r in RENDERS if r[1] or _kustomization(r[0]).get("components")]
PLAIN = [r for r in RENDERS if r not in SECURED]
# Each component alone, on a StatefulSet replica and on LeaderWorkerSet groups: none may rely on another
# (the fsGroup that lets a non-root process read its Secret, for one).
ALONE = [(d, (c,)) for d in ("base", "overlays/lws") for c in COMPONENTS]


def _render_id(key: tuple[str, tuple[str, ...]]) -> str:
    if len(key[1]) == 1:
        return f"{key[0]}+{key[1][0].rpartition('/')[2]}"
    return key[0] + ("+tls" if key[1] else "")


def _components(key: tuple[str, tuple[str, ...]]) -> set[str]:
    """The components a render has: those added, or those its kustomization lists."""
    listed = _kustomization(key[0]).get("components", [])
    return set(key[1]) | {os.path.normpath(os.path.join(key[0], c)) for c in listed}


# The oldest Kubernetes the manifests are written for (the StatefulSet pod-index label is 1.28) and the
# newest whose schemas kubernetes-validate ships. The LeaderWorkerSet overlay needs 1.31: its pod affinity
# uses matchLabelKeys, beta and on by default from 1.31 (an older API server drops the field).
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version())
LWS_KUBERNETES_VERSIONS = ("1.31.0", kubernetes_validate.utils.latest_version())
FROM_ARGS = {
    "router": router_config.from_args,
    "scheduler": scheduler_config.from_args,
    "shard-worker": worker_config.from_args,
}
NAMESPACE = "llama"  # where the pods are made: the docs' examples' namespace
LWS = "leaderworkerset.sigs.k8s.io/"  # the LWS controller's labels and annotations
# Groups made of each LeaderWorkerSet: group 0, and the one a scale-up adds (names must not collide).
LWS_GROUPS = 2
SEED_KNOBS = {  # the seed's values (docs/serving.md)
    "TPSERVE_MAX_NUM_SEQS": "128",
    "TPSERVE_BLOCK_SIZE": "16",
    "TPSERVE_GPU_MEMORY_UTILIZATION": "0.85",
    "TPSERVE_SWAP_SPACE_GIB": "4",
}
# A worker's gRPC port opens only once its shard is loaded: how long its startup probe must allow.
WORKER_STARTUP_BUDGET_S = 30 * 60
# Where the image puts k8s/health_probe.py (k8s/Dockerfile), which the mutual-TLS exec probes run.
HEALTH_PROBE = "/opt/tpserve/k8s/health_probe.py"


# ---------------------------------------------------------------- rendering


def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@functools.cache
def _scratch() -> Path:
    """A directory for this run's generated kustomizations, certificates, mounts and stubs."""
    d = Path(tempfile.mkdtemp(prefix="tpserve-test-k8s-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


@functools.cache
def render(directory: str, components: tuple[str, ...] = ()) -> tuple[dict, ...]:
    """`kubectl kustomize k8s/<directory>`: the objects `kubectl apply -k` would apply; with components,
    those of a kustomization that lists the directory and the components."""
    target = K8S / directory
    if components:
        names = [directory, *(c.rpartition("/")[2] for c in components)]
        target = _scratch() / "kustomizations" / "+".join(names).replace("/", "_")
        target.mkdir(parents=True)
        relative = [os.path.relpath(K8S / d, target) for d in (directory, *components)]
        kustomization = {"resources": relative[:1], "components": relative[1:]}
        (target / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run(
        [str(KUBECTL), "kustomize", str(target)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize k8s/{directory} {components}: {out.stderr}"
    objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]
    ids = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), f"{directory}: duplicate objects {ids}"
    return tuple(objects)


def _by_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _named(objects, kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _labels(obj: dict) -> dict:
    return obj["metadata"].get("labels", {})


def _template_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def _pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _main_container(pod_or_workload: dict) -> dict:
    spec = pod_or_workload["spec"] if pod_or_workload["kind"] == "Pod" else _pod_spec(pod_or_workload)
    containers = spec["containers"]
    assert len(containers) == 1, pod_or_workload["metadata"]["name"]
    return containers[0]


def _lws_templates(lws: dict) -> dict[str, dict]:
    """A LeaderWorkerSet's pod templates by role (the leader's defaults to the workers')."""
    spec = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": spec.get("leaderTemplate", spec["workerTemplate"]), "worker": spec["workerTemplate"]}


def _selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# ---------------------------------------------------------------- the pods the controllers make


def _pod(owner: dict, template: dict, name: str, *, labels=None, annotations=None, env=(), dns=None) -> dict:
    """A pod as the owner's controller makes it from template: its name, the labels and annotations it
    adds, the variables it puts first in every container's env, and (StatefulSet, LWS) the hostname and
    subdomain that give the pod a DNS name in a headless Service."""
    spec = copy.deepcopy(template["spec"])
    if dns is not None:
        spec["hostname"], spec["subdomain"] = dns
    for container in spec["containers"] + spec.get("initContainers", []):
        names = {e["name"] for e in env}
        container["env"] = [*env, *(e for e in container.get("env", []) if e["name"] not in names)]
    metadata = template.get("metadata", {})
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {**metadata.get("labels", {}), **(labels or {})},
            "annotations": {**metadata.get("annotations", {}), **(annotations or {})},
            "ownerReferences": [{"kind": owner["kind"], "name": owner["metadata"]["name"]}],
        },
        "spec": spec,
    }


def _lws_pods(lws: dict) -> list[dict]:
    """A LeaderWorkerSet's groups as LWS v0.10.0 makes them (pkg/webhooks/pod_webhook.go,
    pkg/utils/pod/pod_utils.go, pkg/controllers/pod_controller.go): leader <lws>-<g> (worker index 0),
    workers <lws>-<g>-<i> for i in 1..size-1, all in the headless Service <lws> (subdomainPolicy
    Shared), labelled with the group's index and key, workers annotated with their leader's name, every
    container given LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX first in its env."""
    name = lws["metadata"]["name"]
    spec = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared") == "Shared"
    size = spec.get("size", 1)
    templates = _lws_templates(lws)
    pods = []
    for group in range(LWS_GROUPS):
        leader = f"{name}-{group}"
        group_key = hashlib.sha1(f"{NAMESPACE}/{leader}".encode()).hexdigest()
        for index in range(size):
            pod_name = leader if index == 0 else f"{leader}-{index}"
            labels = {
                LWS + "name": name,
                LWS + "group-index": str(group),
                LWS + "worker-index": str(index),
                LWS + "group-key": group_key,
            }
            annotations = {LWS + "size": str(size), **({LWS + "leader-name": leader} if index else {})}
            env = (
                {"name": "LWS_LEADER_ADDRESS", "value": f"{leader}.{name}.{NAMESPACE}"},
                {"name": "LWS_GROUP_SIZE", "value": str(size)},
                {"name": "LWS_WORKER_INDEX", "value": str(index)},
            )
            template = templates["leader" if index == 0 else "worker"]
            pods.append(
                _pod(
                    lws,
                    template,
                    pod_name,
                    labels=labels,
                    annotations=annotations,
                    env=env,
                    dns=(pod_name, name),
                )
            )
    return pods


def _pods(objects) -> list[dict]:
    pods = []
    for o in objects:
        name = o["metadata"]["name"]
        if o["kind"] == "Deployment":
            pods += [
                _pod(o, o["spec"]["template"], f"{name}-{i}") for i in range(o["spec"].get("replicas", 1))
            ]
        elif o["kind"] == "StatefulSet":
            for ordinal in range(o["spec"].get("replicas", 1)):
                pod_name = f"{name}-{ordinal}"
                labels = {
                    "apps.kubernetes.io/pod-index": str(ordinal),
                    "statefulset.kubernetes.io/pod-name": pod_name,
                }
                pods.append(
                    _pod(
                        o,
                        o["spec"]["template"],
                        pod_name,
                        labels=labels,
                        dns=(pod_name, o["spec"]["serviceName"]),
                    )
                )
        elif o["kind"] == "LeaderWorkerSet":
            pods += _lws_pods(o)
    return pods


def _services(objects) -> list[dict]:
    """The Services in the manifests, plus the headless Service the LWS controller makes for each
    LeaderWorkerSet (pkg/utils/controller/controller_utils.go: named after it, every pod of it selected,
    not-ready addresses published)."""
    made = [
        {
            "kind": "Service",
            "metadata": {"name": o["metadata"]["name"], "labels": {LWS + "name": o["metadata"]["name"]}},
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {LWS + "name": o["metadata"]["name"]},
            },
        }
        for o in _by_kind(objects, "LeaderWorkerSet")
    ]
    return [*_by_kind(objects, "Service"), *made]


def _resolve(host: str, objects, pods) -> dict:
    """The pod a pod DNS name (<hostname>.<subdomain>[.<namespace>[.svc...]]) names: a headless Service
    <subdomain> must select it and publish it before it is ready (ranks must find each other, and the
    scheduler its ranks, before any of them is ready)."""
    hostname, subdomain, *rest = host.split(".")
    assert rest in ([], [NAMESPACE], [NAMESPACE, "svc"], [NAMESPACE, "svc", "cluster", "local"]), host
    (service,) = [s for s in _services(objects) if s["metadata"]["name"] == subdomain] or [None]
    assert service is not None, f"{host}: no Service {subdomain}"
    assert service["spec"].get("clusterIP") == "None", f"{host}: Service {subdomain} is not headless"
    assert service["spec"].get("publishNotReadyAddresses") is True, f"{host}: not resolvable before ready"
    found = [
        p
        for p in pods
        if (p["spec"].get("hostname"), p["spec"].get("subdomain")) == (hostname, subdomain)
        and _selects(service["spec"]["selector"], _labels(p))
    ]
    assert len(found) == 1, f"{host} names {len(found)} pods"
    return found[0]


# ---------------------------------------------------------------- schemas


@functools.cache
def _lws_crd() -> dict:
    return yaml.load(LWS_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _crd_version(crd: dict) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    return version


def _closed(schema):
    """The schema with unknown fields refused, as `kubectl apply` (server-side field validation Strict,
    its default) refuses them for a custom resource, where jsonschema would let them through (and the API
    server, without strict validation, would silently prune them)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    open_ = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_:
        out["additionalProperties"] = False
    return out


@functools.cache
def _lws_validator() -> jsonschema.protocols.Validator:
    # A CRD's openAPIV3Schema is OpenAPI 3.0's subset of JSON Schema draft 4.
    return jsonschema.Draft4Validator(_closed(_crd_version(_lws_crd())["schema"]["openAPIV3Schema"]))


def _validate_lws(obj: dict, where: str) -> None:
    crd = _lws_crd()
    assert obj["apiVersion"] == f"{crd['spec']['group']}/{_crd_version(crd)['name']}", where
    assert obj["kind"] == crd["spec"]["names"]["kind"], where
    errors = sorted(_lws_validator().iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{where}: " + "; ".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # Its pod templates are core PodTemplateSpecs: kubernetes-validate knows them more strictly than the
    # CRD's copy of their schema (formats, the Kubernetes version each field needs).
    for role, template in _lws_templates(obj).items():
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": role},
            "template": template,
        }
        for version in LWS_KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(wrapped, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(
                    f"{where}: {role} template at {'/'.join(map(str, e.path))} ({version}): {e.message}"
                )
