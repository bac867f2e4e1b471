"""gRPC settings and small helpers every process shares."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

import grpc

# Set deliberately rather than left at gRPC's 4 MiB receive default: a step for a full batch of long
# prompts carries a few hundred thousand ints, and a prompt may be sent as token ids.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The internal streams' limit (router -> scheduler -> workers): a request's images travel with it as the
# processor's float32 pixels (9.6 MB for one of Gemma 3's 896 x 896), and one step may introduce several
# such sequences to the workers at once.
INTERNAL_MESSAGE_BYTES = 1024 * 1024 * 1024

OPTIONS = [
    ("grpc.max_send_message_length", INTERNAL_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", INTERNAL_MESSAGE_BYTES),
    # Internal streams stay open for hours; keepalives notice a dead peer instead of waiting forever.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS = OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC sets SO_REUSEPORT by default: a second router started on a taken port would bind it too and
    # silently receive half of the new connections. Off, a taken port is a bind error.
    ("grpc.so_reuseport", 0),
]

# gRPC metadata naming the calling scheduler on every shard worker call (where it serves, host:port),
# and its epoch (when its process started, ns): a worker is leased to one scheduler at a time, and a
# later epoch of the same name is that scheduler restarted (shard_worker/lease.py, worker.proto).
SCHEDULER_METADATA_KEY = "tpserve-scheduler"
SCHEDULER_EPOCH_KEY = "tpserve-scheduler-epoch"


def public_server_options(max_pending_calls: int) -> list[tuple[str, object]]:
    """SERVER_OPTIONS for a server that clients may hit with a burst of new calls (the router).

    A grpc.aio server takes new calls from gRPC core one at a time, on its event loop; calls that arrive
    faster wait in core's queue of calls the application has not yet requested. Core sheds that queue
    with random early detection between grpc.server.max_pending_requests (default 1000) and
    ..._hard_limit (default 3000), and in grpcio 1.85 a shed call ends with CANCELLED and nothing logged
    (src/core/server/server.h; grpc/grpc#34782). Soft limit = hard limit = max_pending_calls: no call
    is shed below it, so each one reaches the router, which answers it (RESOURCE_EXHAUSTED when its own
    queue is full). Core still cancels a call that waits there longer than 30 s
    (grpc.server_max_unrequested_time_in_server)."""
    limits = ("grpc.max_send_message_length", "grpc.max_receive_message_length")
    # Clients' messages keep the public limit (an image comes as a URL or its file's bytes, not pixels).
    return [o for o in SERVER_OPTIONS if o[0] not in limits] + [
        *((name, MAX_MESSAGE_BYTES) for name in limits),
        ("grpc.server.max_pending_requests", max_pending_calls),
        ("grpc.server.max_pending_requests_hard_limit", max_pending_calls),
    ]


def write_port_file(path: str | None, port: int, metrics_port: int | None = None, **more_ports: int) -> None:
    """Tells whoever started us which ports we bound (we bind port 0 to avoid races over free ports).
    more_ports: other ports the process serves (the router's http_port)."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"port": port, "metrics_port": metrics_port, **more_ports}))
    os.replace(tmp, path)


def write_port_error(path: str | None, message: str) -> None:
    """Tells whoever started us why we exited: the port file holds {"error": message} instead."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"error": message}))
    os.replace(tmp, path)


def read_port_file(path: str | Path, timeout: float, alive=lambda: True) -> dict:
    """Waits for a port file written by write_port_file (or write_port_error: then it has "error");
    alive() false means the writer died."""
    deadline = time.monotonic() + timeout
    path = Path(path)
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if not alive():
            raise RuntimeError(f"process died before writing {path}")
        time.sleep(0.05)
    raise TimeoutError(f"no port in {path} after {timeout:.0f}s")


def check_ports_free(host: str, ports: dict[str, int | None]) -> None:
    """ValueError "port N is in use on HOST (--flag)" for the first of ports (flag -> port; 0 and None:
    any port) that another process listens on, or when host is not an address of this machine.

    Servers ask before they load anything, so a taken port fails at once rather than after the model
    loads, and in words: gRPC's own bind error is a RuntimeError naming no cause. A port in TIME_WAIT
    counts as free, as it does for gRPC (both set SO_REUSEADDR).
    """
    for flag, port in ports.items():
        if not port:
            continue
        errors = _bind_errors(host, port)
        if errno.EADDRINUSE in errors:
            raise ValueError(f"port {port} is in use on {host} ({flag})")
        if errors and set(errors) == {errno.EADDRNOTAVAIL}:  # gRPC binds if any address of host does
            raise ValueError(f"--host {host}: not an address of this machine")


def _bind_errors(host: str, port: int) -> list[int]:
    """The errno of binding host:port for each address host resolves to that does not bind."""
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return []  # not a host name: binding says so
    errors = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                errors.append(e.errno)
    return errors


class ReservedPort:
    """A port held for a peer that binds it later, by number: a socket bound with SO_REUSEADDR that never
    listens. Linux then gives the port to no one else (bind(0) and connect() skip it, a plain bind fails),
    while the peer's own SO_REUSEADDR bind (gRPC's, torch.distributed's store) and listen succeed, and
    check_ports_free counts it as free. A port merely found free can be taken in the seconds before its
    peer binds it, by any of the processes a machine runs (CI saw a scheduler's, chosen before its
    workers loaded, taken by a parallel test). Only for peers that cannot bind port 0 and report it."""

    def __init__(self, host: str = "127.0.0.1"):
        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port: int = self._socket.getsockname()[1]

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> ReservedPort:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for_health(
    target: str,
    timeout: float,
    alive=lambda: True,
    credentials: grpc.ChannelCredentials | None = None,
    options: list[tuple[str, object]] | None = None,
) -> None:
    """Blocks until target's grpc.health.v1 service says SERVING; over TLS when credentials are given."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    opts = OPTIONS + (options or [])
    if credentials is None:
        channel = grpc.insecure_channel(target, options=opts)
    else:
        channel = grpc.secure_channel(target, credentials, options=opts)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(f"the server at {target} died while starting")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{target} not SERVING after {timeout:.0f}s")
