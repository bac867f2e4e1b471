"""The `tpserve` command: one subcommand per process, plus launch (all of them) and generate (a client)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from common import logs, security, settings, tracing
from common.grpc_util import write_port_error
from common.sampling import SAMPLING_FIELDS
from router import config as router_config
from router.config import RouterConfig
from scheduler import config as scheduler_config
from scheduler.config import SchedulerConfig
from shard_worker import config as worker_config
from shard_worker.config import WorkerConfig


def _launch_parser(p: argparse.ArgumentParser) -> None:
    from common.launcher import LaunchConfig

    # The router's, scheduler's and workers' flags marked launch=True, declared once in their configs.
    for config in (WorkerConfig, RouterConfig, SchedulerConfig):
        settings.add_arguments(p, config, launch_only=True)
    settings.add_arguments(p, LaunchConfig)
    p.add_argument(
        "--metrics-port", type=int, default=None, help="router /metrics port; the others' are logged (0: any)"
    )
    tracing.add_arguments(p)
    # The router's public TLS, passed through; the internal mutual TLS, given to every process.
    security.add_public_arguments(p)
    security.add_internal_arguments(p)
    security.add_client_arguments(p, api_key=False, title="launch's readiness check of the router's TLS port")


def _generate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (with --chat: the user's message)")
    p.add_argument("--target", default="127.0.0.1:50051", help="router HOST:PORT")
    p.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message in the model's chat template"
    )
    p.add_argument("--system", default=None, help="with --chat: a system message before it")
    p.add_argument("--max-new-tokens", type=int, default=None, help="(default: the server's, 256)")
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


def _bench_parser(p: argparse.ArgumentParser) -> None:
    # Only the benchmark's flags (bench/cli.py imports its client and plotting when it runs).
    from bench import cli as bench_cli

    bench_cli.add_arguments(p)


def _check_comm_parser(p: argparse.ArgumentParser) -> None:
    from shard_worker import comm_check

    comm_check.add_arguments(p)


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
    _bench_parser(sub.add_parser("bench", help="load a server, report latency and throughput"))
    _check_comm_parser(
        sub.add_parser("check-comm", help="all-reduce sweep: is this node fit for tensor parallel?")
    )
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
            if a.chat:
                system = [{"role": "system", "content": a.system}] if a.system else []
                prompt = dict(messages=[*system, {"role": "user", "content": a.prompt}])
            else:
                prompt = dict(text=a.prompt)
            for resp in client.generate(
                **prompt,
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

            if (a.speculative_method == "draft") != bool(a.speculative_model):
                raise ValueError("--speculative-method draft and --speculative-model DIR go together")

            return launch(
                settings.from_args(
                    LaunchConfig,
                    a,
                    model=a.model,
                    host=a.host,
                    device=a.device,
                    router_ports=(
                        ("--port", a.port),
                        ("--http-port", a.http_port),
                        ("--metrics-port", a.metrics_port),
                    ),
                    log_level=a.log_level,
                    log_format=a.log_format,
                    scheduler_args=tuple(settings.to_argv(a, SchedulerConfig)),
                    router_args=tuple(settings.to_argv(a, RouterConfig)),
                    worker_args=tuple(settings.to_argv(a, WorkerConfig)),
                    router_drain_s=a.drain_timeout_s,
                    metrics_port=a.metrics_port,
                    tracing=tracing.from_args(a),
                    tls=security.public_from_args(a),
                    internal_tls=security.internal_from_args(a),
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
        elif a.command == "check-comm":
            from shard_worker import comm_check

            return comm_check.main(a)
        elif a.command == "bench":
            from bench import cli as bench_cli

            return bench_cli.main(a)
    except ValueError as e:
        # A misconfiguration (a flag, the machine: devices, ports; the checkpoint), ours or, for launch, a
        # child's: one line naming it, no traceback, exit 2. A crash keeps its traceback and exits 1.
        print(f"tpserve {a.command}: {e}", file=sys.stderr)
        write_port_error(getattr(a, "port_file", None), str(e))  # for `tpserve launch`, which reports it
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
