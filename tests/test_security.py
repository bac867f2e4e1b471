"""TLS on the public port, mutual TLS between the processes, and API keys, through the real processes.

Certificates come from a throwaway CA made here with `cryptography`; a second, untrusted CA signs the
certificates that must be refused.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import cli
from common.client import GenerationClient
from common.security import read_api_keys
from router import config as router_config
from router.auth import ApiKeys, refusal
from tests.conftest import ROOT, launch

API_KEY = "tps-3f9a6c1e-not-a-real-secret-7d2b"
PROMPT = dict(text="hello", max_new_tokens=4, ignore_eos=True, temperature=0.0)


# ---- a throwaway PKI ----


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert, key) -> tuple[str, str]:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


def _ca(path: Path, cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    _write(path, cert, key)
    return cert, key


def _leaf(path: Path, cn: str, ca) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost, usable as server and as client (one per process)."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return _write(path, cert, key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = _ca(d / "ca", "tpserve test CA"), _ca(d / "rogue-ca", "untrusted CA")
    files = {"ca": str(d / "ca.pem"), "rogue_ca": str(d / "rogue-ca.pem")}
    files["server"], files["server_key"] = _leaf(d / "server", "tpserve", ca)
    files["client"], files["client_key"] = _leaf(d / "client", "a client", ca)
    files["rogue"], files["rogue_key"] = _leaf(d / "rogue", "a stranger", rogue)
    keys = d / "api-keys"
    keys.write_text(f"# one key a line\n\nsome-other-key\n{API_KEY}\n")
    files["api_keys"] = str(keys)
    return files


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def creds(pki, ca="ca", cert=None) -> grpc.ChannelCredentials:
    """Trusts pki[ca]; presents pki[cert] when given."""
    if cert is None:
        return grpc.ssl_channel_credentials(_read(pki[ca]))
    return grpc.ssl_channel_credentials(_read(pki[ca]), _read(pki[f"{cert}_key"]), _read(pki[cert]))


def health(target: str, credentials: grpc.ChannelCredentials | None) -> int:
    """The health status, or raises grpc.RpcError (a refused handshake is UNAVAILABLE)."""
    if credentials is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, credentials)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def refused(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


@pytest.fixture(scope="module")
def stack(tiny_model, pki):
    """Everything on: TLS on the public port, mutual TLS inside, API keys; logging at DEBUG."""
    flags = ["--tls-cert", pki["server"], "--tls-key", pki["server_key"], "--tls-ca", pki["ca"]]
    flags += ["--internal-tls-cert", pki["server"], "--internal-tls-key", pki["server_key"]]
    flags += ["--internal-tls-ca", pki["ca"], "--api-key-file", pki["api_keys"]]
    with launch(tiny_model, *flags, log_level="DEBUG") as (target, info):
        yield target, info


def _client(target, pki, key: str | None = API_KEY, **kw) -> GenerationClient:
    metadata = [("authorization", f"Bearer {key}")] if key else []
    return GenerationClient(target, timeout=30, credentials=creds(pki, **kw), metadata=metadata)


# ---- public TLS ----


def test_tls_client_with_the_ca_generates(stack, pki):
    target, _ = stack
    with _client(target, pki) as client:
        out = client.complete(**PROMPT)
    assert len(out.token_ids) == 4 and out.finish_reason_name == "LENGTH"


def test_plaintext_and_untrusting_clients_are_refused(stack, pki):
    target, _ = stack
    metadata = [("authorization", f"Bearer {API_KEY}")]
    with GenerationClient(target, timeout=5, metadata=metadata) as plain:
        assert refused(lambda: plain.complete(**PROMPT)) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA does not accept the router's certificate.
    with _client(target, pki, ca="rogue_ca") as other:
        assert refused(lambda: other.complete(**PROMPT)) == grpc.StatusCode.UNAVAILABLE


def test_generate_cli_over_tls_with_a_key_file(stack, pki, tmp_path):
    target, _ = stack
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    cmd = [sys.executable, "-m", "common.cli", "generate", "hello", "--target", target]
    cmd += ["--max-new-tokens", "3", "--ignore-eos", "--tls-ca", pki["ca"], "--api-key-file", str(key_file)]
    ok = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    no_key = subprocess.run(cmd[:-2], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert no_key.returncode == 1 and "UNAUTHENTICATED" in no_key.stderr


# ---- internal mutual TLS ----


def test_internal_ports_refuse_clients_without_a_valid_certificate(stack, pki):
    _, info = stack
    for target in [info["scheduler"], *info["workers"]]:
        # The control: with a certificate the CA signed, the port answers.
        assert health(target, creds(pki, cert="client")) == health_pb2.HealthCheckResponse.SERVING
        assert refused(lambda t=target: health(t, None)) == grpc.StatusCode.UNAVAILABLE
        assert refused(lambda t=target: health(t, creds(pki))) == grpc.StatusCode.UNAVAILABLE
        # Trusting the right CA is not enough: the client's own certificate must chain to it.
        rogue = creds(pki, cert="rogue")
        assert refused(lambda t=target, c=rogue: health(t, c)) == grpc.StatusCode.UNAVAILABLE


# ---- API keys ----


def test_api_keys(stack, pki):
    target, _ = stack
    with _client(target, pki, key=None) as client:
        e = pytest.raises(grpc.RpcError, client.complete, **PROMPT).value
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in e.details()
        # GetStats and GetModelInfo are behind the key too.
        assert refused(client.stats) == grpc.StatusCode.UNAUTHENTICATED
    wrong = API_KEY[:-1] + "X"
    with _client(target, pki, key=wrong) as client:
        e = pytest.raises(grpc.RpcError, client.complete, **PROMPT).value
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and wrong not in e.details()
    with _client(target, pki, key="some-other-key") as client:
        assert len(client.complete(**PROMPT).token_ids) == 4
    # Probes need no key.
    assert health(target, creds(pki)) == health_pb2.HealthCheckResponse.SERVING


def test_no_key_reaches_the_log(stack, pki):
    target, info = stack
    with _client(target, pki, key="a-wrong-key-xyz") as client:
        refused(lambda: client.complete(**PROMPT))
    log = Path(info["log"]).read_text(errors="replace")
    assert "refused" in log  # DEBUG logging was on: the refusals were logged, without keys
    for secret in (API_KEY, "some-other-key", "a-wrong-key-xyz", "BEGIN PRIVATE KEY"):
        assert secret not in log


# ---- public mutual TLS ----


def test_public_mutual_tls_refuses_clients_without_a_certificate(tiny_model, pki):
    flags = ["--tls-cert", pki["server"], "--tls-key", pki["server_key"], "--tls-client-ca", pki["ca"]]
    # The launcher's readiness check is a client too: it needs a certificate of its own.
    flags += ["--tls-ca", pki["ca"], "--tls-client-cert", pki["client"]]
    flags += ["--tls-client-key", pki["client_key"]]
    with launch(tiny_model, *flags) as (target, _):
        with _client(target, pki, key=None, cert="client") as client:
            assert len(client.complete(**PROMPT).token_ids) == 4
        for kw in ({}, {"cert": "rogue"}):
            with _client(target, pki, key=None, **kw) as client:
                assert refused(lambda c=client: c.complete(**PROMPT)) == grpc.StatusCode.UNAVAILABLE


# ---- the pieces, without processes ----


def test_refusal_messages():
    keys = ApiKeys(["k1", "k2"])
    assert refusal(keys, [("authorization", "Bearer k2")]) is None
    assert refusal(keys, [("authorization", "bearer  k1 ")]) is None  # the scheme is case-insensitive
    assert "missing" in refusal(keys, [])
    assert "Bearer" in refusal(keys, [("authorization", "k1")])
    assert "Bearer" in refusal(keys, [("authorization", "Basic k1")])
    assert "not valid" in refusal(keys, [("authorization", "Bearer k3")])
    assert "more than one" in refusal(keys, [("authorization", "Bearer k1"), ("authorization", "Bearer k2")])
    assert "k1" not in repr(keys)


def test_key_file_rules(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n\n  abc  \ndef\n")
    assert read_api_keys(str(f)) == ["abc", "def"]
    f.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="holds no keys"):
        read_api_keys(str(f))
    f.write_text("two words\n")
    with pytest.raises(ValueError, match="line 1") as e:
        read_api_keys(str(f))
    assert "two words" not in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        read_api_keys(str(tmp_path / "missing"))


def test_flag_mistakes_are_start_up_errors(pki, tmp_path):
    parser = argparse.ArgumentParser()
    router_config.add_arguments(parser)
    base = ["--scheduler", "127.0.0.1:1", "--model", "m"]
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82")
    internal = ["--internal-tls-cert", pki["server"], "--internal-tls-key", pki["server_key"]]
    for flags, message in [
        (["--tls-cert", pki["server"]], "go together"),
        (["--tls-client-ca", pki["ca"]], "needs --tls-cert"),
        (["--tls-cert", str(not_pem), "--tls-key", pki["server_key"]], "not PEM"),
        (internal, "missing --internal-tls-ca"),
    ]:
        with pytest.raises(ValueError, match=message):
            router_config.from_args(parser.parse_args(base + flags))
    assert cli.main(["router", *base, "--tls-cert", pki["server"]]) == 2  # said on stderr, no traceback
