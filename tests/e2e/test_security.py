"""TLS on the public port, mutual TLS between the processes, and API keys, through the real processes.

Certificates come from a throwaway CA made here with `cryptography`; a second, untrusted CA signs the
certificates that must be refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.client import GenerationClient
from tests.conftest import ROOT, launch
from tests.pki import API_KEY

PROMPT = dict(text="hello", max_new_tokens=4, ignore_eos=True, temperature=0.0)


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
