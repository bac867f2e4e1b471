"""A throwaway PKI for the TLS tests: a CA, certificates it signed, and a second, untrusted CA's."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

API_KEY = "tps-3f9a6c1e-not-a-real-secret-7d2b"


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


def make_pki(d: Path) -> dict[str, str]:
    """Writes the CA, certificates and an API key file into d; returns their paths by name."""
    ca, rogue = _ca(d / "ca", "tpserve test CA"), _ca(d / "rogue-ca", "untrusted CA")
    files = {"ca": str(d / "ca.pem"), "rogue_ca": str(d / "rogue-ca.pem")}
    files["server"], files["server_key"] = _leaf(d / "server", "tpserve", ca)
    files["client"], files["client_key"] = _leaf(d / "client", "a client", ca)
    files["rogue"], files["rogue_key"] = _leaf(d / "rogue", "a stranger", rogue)
    keys = d / "api-keys"
    keys.write_text(f"# one key a line\n\nsome-other-key\n{API_KEY}\n")
    files["api_keys"] = str(keys)
    return files
