"""TLS and API keys on Kubernetes (k8s/components): off unless a component is listed, every process
reading its files from the Secrets the docs create, and the internal certificate and exec health probe
checked against a real gRPC server."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import security
from tests.unit.k8s_commands import Process, _health_probe, _mount_path, _of, processes
from tests.unit.k8s_render import (
    ALONE,
    COMPONENTS,
    K8S,
    PLAIN,
    RENDERS,
    SECURED,
    _components,
    _render_id,
    _resolve,
    render,
)
from tests.unit.k8s_secrets import (
    INTERNAL_SECRET,
    _documented_certificate,
    _mount,
    _pki,
    _secret_volumes,
    _secrets,
)

# ---------------------------------------------------------------- TLS and API keys (k8s/components)


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
    """A grpc.health.v1 server with the docs' internal certificate, requiring a client certificate from
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
    """Whether a client with the docs' internal certificate, dialling a peer it knows as `name`, gets
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
    """One certificate for every process (the docs' cert-manager Certificate, written to the Secret the
    component mounts) must carry the name of every peer each process dials in every overlay, and of
    what the exec probes check; gRPC's hostname check decides, with the certificate issued for them."""
    port, _ = internal_server
    certificate = _documented_certificate()
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
    assert not refused, f"the docs' certificate lacks {refused}"
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
