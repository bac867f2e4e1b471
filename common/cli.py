"""The `tpserve` command: one subcommand per process, plus launch (all of them) and generate (a client)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench import cli as bench_cli
from common import logs, security, tracing
from common.sampling import SAMPLING_FIELDS
from router import config as router_config
from scheduler import config as scheduler_config
from shard_worker import config as worker_config


def _launch_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size: shard workers, one per device")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="model replicas (a scheduler and --tp workers each) behind the router",
    )
    p.add_argument("--host", default="127.0.0.1", help="router address (0.0.0.0 to serve other hosts)")
    p.add_argument("--port", type=int, default=50051, help="router port (0: any free port)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=worker_config.DTYPES)
    p.add_argument("--ready-file", default=None, help="write {target, pids} as JSON here once serving")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for SERVING")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart a dead scheduler or worker group this many times (0: a death stops the launch)",
    )
    scheduler_config.add_policy_arguments(p)
    router_config.add_policy_arguments(p)
    p.add_argument(
        "--metrics-port", type=int, default=None, help="router /metrics port; the others' are logged (0: any)"
    )
    tracing.add_arguments(p)
    # The router's public TLS and API keys, passed through; the internal mutual TLS, given to every process.
    router_config.add_security_arguments(p)
    security.add_internal_arguments(p)
    security.add_client_arguments(p, api_key=False, title="launch's readiness check of the router's TLS port")


def _generate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--target", default="127.0.0.1:50051", help="router HOST:PORT")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    security.add_client_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="json: one object a line"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _launch_parser(sub.add_parser("launch", help="run router, scheduler and shard workers on this machine"))
    router_config.add_arguments(sub.add_parser("router", help="the public gRPC entry point"))
    scheduler_config.add_arguments(sub.add_parser("scheduler", help="the batch planner and KV block owner"))
    worker_config.add_arguments(sub.add_parser("shard-worker", help="one tensor-parallel rank of the model"))
    _generate_parser(sub.add_parser("generate", help="stream a completion from a running server"))
    bench_cli.add_arguments(sub.add_parser("bench", help="load a server, report latency and throughput"))
    return parser


def _generate(a: argparse.Namespace) -> int:
    import grpc

    from common.client import GenerationClient

    sampling = {k: getattr(a, k) for k in SAMPLING_FIELDS if getattr(a, k) is not None}
    auth = security.client_from_args(a)
    try:
        with GenerationClient(
            a.target,
            timeout=a.timeout,
            credentials=auth.credentials(),
            metadata=auth.metadata,
            options=auth.options(),
        ) as client:
            for resp in client.generate(
                text=a.prompt,
                max_new_tokens=a.max_new_tokens,
                stop=a.stop,
                ignore_eos=a.ignore_eos,
                **sampling,
            ):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    except grpc.RpcError as e:
        print(f"\ntpserve: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logs.setup(a.log_level, a.log_format, a.command)
    try:
        if a.command == "launch":
            from common.launcher import LaunchConfig, launch

            passthrough = {"scheduler": [], "router": []}
            for process, names in (
                ("scheduler", scheduler_config.POLICY_FLAGS),
                ("router", router_config.POLICY_FLAGS),
            ):
                for name in names:
                    flag, value = name.replace("_", "-"), getattr(a, name)
                    if isinstance(value, bool):
                        passthrough[process].append(f"--{flag}" if value else f"--no-{flag}")
                    elif isinstance(value, tuple):
                        passthrough[process] += [f"--{flag}", ",".join(map(str, value))]
                    else:
                        passthrough[process] += [f"--{flag}", str(value)]
            return launch(
                LaunchConfig(
                    model=a.model,
                    tp=a.tp,
                    replicas=a.replicas,
                    host=a.host,
                    port=a.port,
                    device=a.device,
                    dtype=a.dtype,
                    ready_file=a.ready_file,
                    startup_timeout_s=a.startup_timeout,
                    log_level=a.log_level,
                    log_format=a.log_format,
                    scheduler_args=tuple(passthrough["scheduler"]),
                    router_args=tuple(passthrough["router"]),
                    router_drain_s=a.drain_timeout_s,
                    metrics_port=a.metrics_port,
                    tracing=tracing.from_args(a),
                    max_restarts=a.max_restarts,
                    tls=security.public_from_args(a),
                    internal_tls=security.internal_from_args(a),
                    api_key_file=a.api_key_file,
                    health_auth=security.client_from_args(a),
                )
            )
        if a.command == "router":
            from router.server import serve

            asyncio.run(serve(router_config.from_args(a)))
        elif a.command == "scheduler":
            from scheduler.server import serve

            asyncio.run(serve(scheduler_config.from_args(a)))
        elif a.command == "shard-worker":
            from shard_worker.server import serve

            serve(worker_config.from_args(a))
        elif a.command == "generate":
            return _generate(a)
        elif a.command == "bench":
            return bench_cli.main(a)
    except ValueError as e:  # configuration errors: say what is wrong, no traceback
        print(f"tpserve {a.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
