"""The `tpserve` command: one subcommand per process, plus launch (all of them) and generate (a client).

Each subcommand lives in its own module, imported only when that subcommand runs: a shard worker loads
no router code and a router no torch (tests/unit/test_layering.py). A module defines
add_arguments(parser) and main(args) -> exit code (None: 0).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from common import flag_groups, logs
from common.grpc_util import write_port_error

# name -> (help, the module that parses and runs it)
COMMANDS = {
    "launch": ("run router, scheduler and shard workers on this machine", "common.launch"),
    "router": ("the public gRPC entry point", "router.server"),
    "scheduler": ("the batch planner and KV block owner", "scheduler.server"),
    "shard-worker": ("one tensor-parallel rank of the model", "shard_worker.server"),
    "generate": ("stream a completion from a running server", "common.generate"),
    "bench": ("load a server, report latency and throughput", "bench.cli"),
    "check-comm": ("all-reduce sweep: is this node fit for tensor parallel?", "shard_worker.comm_check"),
}
# Where each command is explained (paths in the repository; the same pages on the built site).
DOCS = {
    "launch": "docs/serving.md",
    "router": "docs/replicas.md",
    "scheduler": "docs/serving.md#scheduler-flags",
    "shard-worker": "docs/serving.md#shard-worker-flags",
    "generate": "docs/api/grpc.md",
    "bench": "docs/benchmarks.md",
    "check-comm": "docs/deployment/kubernetes.md",
}
# Options before the subcommand that take a value (to find the subcommand without parsing everything).
_GLOBAL_VALUES = ("--log-level", "--log-format")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported for its flags (every subcommand is listed)."""
    parser = argparse.ArgumentParser(prog="tpserve", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="json: one object a line"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, module) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            usage="%(prog)s [options]",
            description=f"tpserve {name}: {help_text}.",
            epilog=f"Every flag with its default: docs/reference/cli.md#tpserve-{name}; how to use them: "
            f"{DOCS[name]} (in the repository, or the site `make docs` builds).",
        )
        if name == command:
            importlib.import_module(module).add_arguments(p)
            flag_groups.arrange(p, name)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The subcommand argv names, if any: the first word that is not a global option or its value."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word in _GLOBAL_VALUES:
            skip = True
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser(command_of(argv)).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    logs.setup(a.log_level, a.log_format, a.command)
    try:
        return importlib.import_module(COMMANDS[a.command][1]).main(a) or 0
    except ValueError as e:
        # A misconfiguration (a flag, the machine: devices, ports; the checkpoint), ours or, for launch, a
        # child's: one line naming it, no traceback, exit 2. A crash keeps its traceback and exits 1.
        print(f"tpserve {a.command}: {e}", file=sys.stderr)
        write_port_error(getattr(a, "port_file", None), str(e))  # for `tpserve launch`, which reports it
        return 2


if __name__ == "__main__":
    sys.exit(main())
