"""TLS for every gRPC port and channel, from certificate files given as flags.

Two planes, each optional:
- public: the router's port. --tls-cert/--tls-key serve TLS; --tls-client-ca also makes clients present a
  certificate that CA signed (mutual TLS for the public API).
- internal: router -> scheduler -> shard workers. --internal-tls-cert/--internal-tls-key/--internal-tls-ca,
  all three or none. Every internal server requires a client certificate signed by the CA, and every
  internal client presents its certificate and checks the peer's against the same CA. One certificate
  per process (or one for all) serves both sides, so it needs both the serverAuth and clientAuth
  extended key usages, and subject alternative names for the hosts the others dial.

Only file paths are held in configs; the bytes are read when a port or channel is made, so a config's
repr never carries a private key. Without TLS the helpers fall back to the insecure forms, which is the
default: internal services then bind loopback only (see the processes' --host).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.grpc_util import check_ports_free


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _check_readable(flag: str, path: str, pem: bool = True) -> None:
    """A clear start-up error instead of a failed handshake later. pem: the file must hold PEM blocks
    (gRPC takes no DER and no passphrase-protected key)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
    if pem and b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not PEM (expected a -----BEGIN ...----- block)")
    if pem and (b"BEGIN ENCRYPTED PRIVATE KEY" in data or b"Proc-Type: 4,ENCRYPTED" in data):
        raise ValueError(f"{flag} {path}: an encrypted private key; gRPC needs it unencrypted")


@dataclass(frozen=True)
class TlsFiles:
    """A certificate chain, its private key, and the CA that peers' certificates must chain to.

    As a server: ca set means clients must present a certificate that ca signed. As a client: the
    certificate is presented to the server, and ca verifies the server (None: the system's roots).
    """

    cert: str
    key: str
    ca: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.ca),
            require_client_auth=self.ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca), private_key=_read(self.key), certificate_chain=_read(self.cert)
        )


def add_port(server, address: str, tls: TlsFiles | None) -> int:
    """Binds address on a grpc.Server or grpc.aio.Server: TLS when tls is given; returns the port.

    ValueError when the port is taken (check_ports_free) or gRPC cannot bind it for another reason."""
    host, _, port = address.rpartition(":")
    check_ports_free(host, {"--port": int(port)})
    try:
        if tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.server_credentials())
    except RuntimeError:  # "Failed to bind": a race to the port lost since the check, or a foreign host
        raise ValueError(
            f"cannot bind {address}: in use, or not an address of this machine (--host)"
        ) from None


def channel(target: str, tls: TlsFiles | None, options: Sequence[tuple[str, object]]) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.channel_credentials(), options=options)


def aio_channel(target: str, tls: TlsFiles | None, options: Sequence[tuple[str, object]]) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)


# ---- flags ----


def add_internal_arguments(p: argparse.ArgumentParser) -> None:
    """Mutual TLS between router, scheduler and shard workers: every process takes the same three."""
    g = p.add_argument_group("internal mutual TLS (router, scheduler, shard workers; all three or none)")
    g.add_argument("--internal-tls-cert", default=None, help="PEM certificate chain this process presents")
    g.add_argument("--internal-tls-key", default=None, help="PEM private key of --internal-tls-cert")
    g.add_argument(
        "--internal-tls-ca", default=None, help="PEM CA that every peer's certificate must chain to"
    )


def internal_from_args(a: argparse.Namespace) -> TlsFiles | None:
    paths = {
        "--internal-tls-cert": a.internal_tls_cert,
        "--internal-tls-key": a.internal_tls_key,
        "--internal-tls-ca": a.internal_tls_ca,
    }
    given = [flag for flag, path in paths.items() if path]
    if not given:
        return None
    if len(given) != len(paths):
        missing = ", ".join(flag for flag in paths if flag not in given)
        raise ValueError(f"internal mutual TLS needs all of --internal-tls-cert/-key/-ca; missing {missing}")
    for flag, path in paths.items():
        _check_readable(flag, path)
    return TlsFiles(a.internal_tls_cert, a.internal_tls_key, a.internal_tls_ca)


def add_public_arguments(p: argparse.ArgumentParser) -> None:
    """TLS on the router's public port."""
    g = p.add_argument_group("TLS for the public port")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain the router serves")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA: clients must present a certificate it signed (mutual TLS on the public port)",
    )


def public_from_args(a: argparse.Namespace) -> TlsFiles | None:
    if not a.tls_cert and not a.tls_key:
        if a.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (client certificates need TLS)")
        return None
    if not (a.tls_cert and a.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    for flag, path in (
        ("--tls-cert", a.tls_cert),
        ("--tls-key", a.tls_key),
        ("--tls-client-ca", a.tls_client_ca),
    ):
        if path:
            _check_readable(flag, path)
    return TlsFiles(a.tls_cert, a.tls_key, a.tls_client_ca)


def public_flags(tls: TlsFiles | None) -> list[str]:
    """The router's command-line flags for tls (what `tpserve launch` passes through)."""
    if tls is None:
        return []
    flags = ["--tls-cert", tls.cert, "--tls-key", tls.key]
    return flags + (["--tls-client-ca", tls.ca] if tls.ca else [])


def internal_flags(tls: TlsFiles | None) -> list[str]:
    if tls is None:
        return []
    return ["--internal-tls-cert", tls.cert, "--internal-tls-key", tls.key, "--internal-tls-ca", tls.ca or ""]


# ---- the public API's clients (tpserve generate, bench, launch's readiness check) ----


@dataclass(frozen=True)
class ClientAuth:
    """How a client reaches the router: TLS (verified with ca, or the system's roots), an optional client
    certificate, and an optional API key sent as `authorization: Bearer <key>`."""

    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr or a log line
    # Checked against the router certificate's names instead of the host dialled (e.g. a public DNS
    # name while dialling 127.0.0.1).
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca), private_key=_read(self.key), certificate_chain=_read(self.cert)
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def options(self) -> list[tuple[str, object]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []

    def aio_channel(self, target: str, options: Sequence[tuple[str, object]]) -> grpc.aio.Channel:
        opts = [*options, *self.options()]
        creds = self.credentials()
        if creds is None:
            return grpc.aio.insecure_channel(target, options=opts)
        return grpc.aio.secure_channel(target, creds, options=opts)


PLAINTEXT = ClientAuth()  # no TLS, no key: the default


def add_client_arguments(
    p: argparse.ArgumentParser, *, api_key: bool = True, title: str = "reaching the router: TLS and API key"
) -> None:
    """A client's flags. api_key False: TLS only (launch's readiness check: health needs no key)."""
    g = p.add_argument_group(title)
    if api_key:
        g.add_argument(
            "--tls", action="store_true", help="use TLS, verifying the router with the system's roots"
        )
    g.add_argument("--tls-ca", default=None, help="PEM CA that verifies the router's certificate")
    g.add_argument("--tls-client-cert", default=None, help="PEM certificate to present to the router")
    g.add_argument("--tls-client-key", default=None, help="PEM private key of --tls-client-cert")
    g.add_argument(
        "--tls-server-name", default=None, help="name the router's certificate must carry (default: the host)"
    )
    if api_key:
        g.add_argument(
            "--api-key",
            default=None,
            help="sent as `authorization: Bearer KEY` (shows in ps: see --api-key-file)",
        )
        g.add_argument(
            "--api-key-file", default=None, help="a file whose first key (see the router's) is sent"
        )


def client_from_args(a: argparse.Namespace, *, tls: bool = False) -> ClientAuth:
    """tls True: TLS whatever the flags say (launch, when the router serves TLS)."""
    if bool(a.tls_client_cert) != bool(a.tls_client_key):
        raise ValueError("--tls-client-cert and --tls-client-key go together")
    for flag, path in (
        ("--tls-ca", a.tls_ca),
        ("--tls-client-cert", a.tls_client_cert),
        ("--tls-client-key", a.tls_client_key),
    ):
        if path:
            _check_readable(flag, path)
    key, key_file = getattr(a, "api_key", None), getattr(a, "api_key_file", None)
    if key and key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file:
        key = read_api_keys(key_file)[0]
    return ClientAuth(
        tls=bool(tls or getattr(a, "tls", False) or a.tls_ca or a.tls_client_cert),
        ca=a.tls_ca,
        cert=a.tls_client_cert,
        key=a.tls_client_key,
        api_key=key,
        server_name=a.tls_server_name,
    )


# ---- API keys ----


def read_api_keys(path: str, flag: str = "--api-key-file") -> list[str]:
    """One key a line; blank lines and lines starting with # are skipped. An empty file is an error, not
    "no keys required": a deployment that meant to require keys must not silently serve everyone."""
    _check_readable(flag, path, pem=False)
    keys = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        # The key goes into an HTTP/2 header value; say which line is wrong, never what is on it.
        if any(c.isspace() for c in key) or not key.isascii() or not key.isprintable():
            raise ValueError(f"{flag} {path}: line {number} is not one key of printable ASCII without spaces")
        keys.append(key)
    if not keys:
        raise ValueError(f"{flag} {path}: holds no keys")
    return keys
