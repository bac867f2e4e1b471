"""API keys and TLS flags, without processes (the TLS handshakes themselves: tests/e2e/test_security.py)."""

from __future__ import annotations

import argparse

import pytest

from common import cli
from common.security import read_api_keys
from router import config as router_config
from router.auth import ApiKeys, refusal


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
