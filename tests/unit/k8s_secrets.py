"""The Secrets the docs' `kubectl create secret` commands make, the certificates they hold, and the files a
pod sees where it mounts them."""

from __future__ import annotations

import base64
import datetime
import functools
import json
import re
import shlex
import subprocess
from pathlib import Path

import yaml

from tests.unit.k8s_render import DOCS, KUBECTL, _scratch

# ---------------------------------------------------------------- Secrets, certificates, mounts


def _documented_certificate() -> dict:
    """The cert-manager Certificate the docs show for the internal mutual TLS: the names it documents."""
    docs = "\n".join(p.read_text() for p in DOCS)
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", docs, re.S)]
    (certificate,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "Certificate"]
    return certificate


@functools.cache
def _pki() -> Path:
    """A throwaway CA (ca.pem), the internal certificate with the docs' names and usages (internal.*), a
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
    internal = _documented_certificate()["spec"]
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


# the docs' commands that make the Secrets, one per line or continued with a backslash.
SECRET_COMMAND = re.compile(r"^kubectl -n <namespace> create secret (?:[^\n\\]|\\\n)*", re.M)


@functools.cache
def _secrets() -> dict[str, dict[str, bytes]]:
    """The Secrets the docs' `kubectl create secret` commands make (run by kubectl, --dry-run=client, in a
    directory holding the files they name, from _pki), by name: their keys and bytes."""
    commands = SECRET_COMMAND.findall("\n".join(p.read_text() for p in DOCS))
    assert len(commands) >= 3, "the docs show how to create the Secrets the components mount"
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
        assert out.returncode == 0, f"the docs' `{command}`: {out.stderr}"
        secret = json.loads(out.stdout)
        secrets[secret["metadata"]["name"]] = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    return secrets


def _mount(pod: dict, container: dict) -> dict[str, Path]:
    """The kubelet's mounts of the container's Secret volumes: each mountPath becomes a directory of
    its own holding what the volume projects from the docs' Secret (its items, or every key), so that the
    CLI's checks (a readable PEM file) see what the process would. mountPath -> that directory."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("secret")
        if source is None:
            continue
        secrets = _secrets()
        where = f"{pod['metadata']['name']}: volume {mount['name']}"
        assert source["secretName"] in secrets, f"{where}: the docs create no Secret {source['secretName']}"
        data = secrets[source["secretName"]]
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        d = _scratch() / "mounts" / pod["metadata"]["name"] / mount["name"]
        d.mkdir(parents=True, exist_ok=True)
        for item in items:
            assert item["key"] in data, f"{where}: Secret {source['secretName']} has no key {item['key']}"
            (d / item["path"]).write_bytes(data[item["key"]])
        mounts[mount["mountPath"].rstrip("/")] = d
    return mounts


INTERNAL_SECRET = "tpserve-internal-tls"


def _secret_volumes(pod: dict) -> list[dict]:
    return [v for v in pod["spec"].get("volumes", []) if "secret" in v]
