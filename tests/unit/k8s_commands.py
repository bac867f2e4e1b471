"""Each container's command line as the pod would run it (variables expanded, a shell wrapper run by a
real shell), parsed by the real CLI into the process it starts."""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from common import cli
from tests.unit.k8s_render import (
    FROM_ARGS,
    HEALTH_PROBE,
    _by_kind,
    _labels,
    _main_container,
    _pods,
    _resolve,
    _scratch,
    render,
)
from tests.unit.k8s_secrets import _mount

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
