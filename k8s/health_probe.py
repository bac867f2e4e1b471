"""The kubelet's probe of a process whose port requires mutual TLS (k8s/components/internal-mtls).

The kubelet's own `grpc:` probe speaks plaintext and cannot present a client certificate, so with
internal mutual TLS on, the scheduler's and the shard workers' probes run this instead (an exec probe):
one grpc.health.v1 Check on 127.0.0.1, presenting the pod's own certificate from the mounted Secret and
verifying the server's against its CA and --server-name, the name its peers check (docs/deployment/tls.md).
`{VAR}` in that name is the container's variable VAR, e.g. a rank's {POD_DNS_NAME}: the
kubelet expands no downward-API variable in a probe's command. Exit status 0 when SERVING; anything
else (NOT_SERVING, refused, a handshake failure, a timeout) exits non-zero with the reason, which the
kubelet records in the pod's events.

The image carries it as /opt/tpserve/k8s/health_probe.py (k8s/Dockerfile); it imports only grpcio and
grpcio-health-checking, not tpserve, so that a probe costs one small process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True, help="the process's gRPC port (its --port)")
    p.add_argument("--server-name", required=True, help="the name its peers check; {VAR}: env var VAR")
    p.add_argument("--tls-dir", required=True, help="the mounted Secret: tls.crt, tls.key and ca.crt")
    p.add_argument("--timeout-s", type=float, default=3.0)
    a = p.parse_args(argv)
    try:
        server_name = a.server_name.format_map(os.environ)
    except KeyError as e:
        print(f"--server-name {a.server_name}: no variable {e} in the environment", file=sys.stderr)
        return 1
    pem = {name: (Path(a.tls_dir) / name).read_bytes() for name in ("tls.crt", "tls.key", "ca.crt")}
    credentials = grpc.ssl_channel_credentials(pem["ca.crt"], pem["tls.key"], pem["tls.crt"])
    options = [("grpc.ssl_target_name_override", server_name)]
    with grpc.secure_channel(f"127.0.0.1:{a.port}", credentials, options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=a.timeout_s
            )
        except grpc.RpcError as e:
            print(f"health check failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
