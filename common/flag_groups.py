"""Which group each flag shows in, in `tpserve <command> --help` and in docs/reference/cli.md.

Flags are declared where their process reads them (config fields, common/settings.py; tracing, metrics and
security's add_arguments); this table only arranges them for a reader, so a new flag needs one line here
and nothing else. A flag not listed stays under argparse's "options" (tests/unit/test_docs.py fails then,
naming it). Plain Python: argparse only.
"""

from __future__ import annotations

import argparse

# title -> (what the group is for, its flags), in the order --help shows them.
SERVER_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "model": (
        "what is served and in which form its weights are held",
        (
            "--model", "--served-model-name", "--tokenizer", "--dtype", "--linear-dtype", "--quantization",
            "--load-format",
        ),
    ),
    "LoRA adapters": (
        "adapters served beside the base model",
        ("--enable-lora", "--lora-modules", "--max-lora-rank", "--max-loras", "--max-cpu-loras"),
    ),
    "parallelism and devices": (
        "ranks, replicas, devices and kernels",
        (
            "--tp", "--replicas", "--rank", "--world-size", "--dist-init", "--worker", "--device",
            "--num-threads", "--attention-backend", "--cuda-graphs", "--enforce-eager",
            "--compile-cache-dir",
        ),
    ),
    "cache": (
        "the paged KV cache, its prefix cache and host memory",
        (
            "--block-size", "--num-kv-blocks", "--gpu-memory-utilization", "--cpu-kv-cache-gib",
            "--kv-cache-dtype", "--enable-prefix-caching", "--swap-space", "--host-prefix-cache",
        ),
    ),
    "batching": (
        "what each iteration runs",
        (
            "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--batching",
            "--static-batch-size", "--static-batch-timeout-ms", "--min-batch-size",
            "--batch-wait-timeout-ms", "--fallback-static", "--async-scheduling", "--admission-window",
        ),
    ),
    "speculative decoding": (
        "proposals verified in one step",
        (
            "--speculative-method", "--speculative-model", "--num-speculative-tokens", "--prompt-lookup-max",
            "--prompt-lookup-min", "--speculative-disable-by-batch-size",
        ),
    ),
    "routing": (
        "the replicas, the router's queue and the choice of replica",
        (
            "--scheduler", "--scheduler-dns", "--scheduler-dns-interval-s", "--scheduler-retry-s",
            "--routing-policy", "--routing-cache-weight", "--routing-host-cache-weight",
            "--routing-cache-index-blocks", "--replica-stale-s", "--replica-wait-timeout-s",
            "--max-request-attempts", "--bucket-edges", "--max-queued-requests", "--max-queue-wait-ms",
            "--max-pending-calls",
        ),
    ),
    "objectives": (
        "latency objectives and admission by them",
        (
            "--slo-ttft-ms", "--slo-tpot-ms", "--slo-tpot-margin", "--min-ttft-objective-ms",
            "--min-tpot-objective-ms", "--priority-api-key-file",
        ),
    ),
    "API": (
        "ports and what a request may ask",
        (
            "--host", "--port", "--port-file", "--http-port", "--max-prompt-tokens", "--max-new-tokens-limit",
            "--default-max-new-tokens", "--tool-call-parser", "--reasoning-parser",
            "--disable-additional-properties", "--responses-store-size",
            "--drain-timeout-s",
        ),
    ),
    "images": (
        "image parts in chat requests: what the router may read, and how much",
        (
            "--allowed-media-domains", "--allowed-local-media-path", "--limit-mm-per-prompt",
            "--max-image-pixels", "--max-image-bytes", "--media-fetch-timeout-s",
        ),
    ),
    "start-up and recovery": (
        "waiting for processes, and what happens when one is lost",
        (
            "--ready-file", "--startup-timeout", "--max-restarts", "--worker-connect-timeout-s",
            "--step-timeout-s", "--worker-recovery-timeout-s",
        ),
    ),
    "security": (
        "TLS, mutual TLS between the processes, API keys",
        (
            "--tls-cert", "--tls-key", "--tls-client-ca", "--internal-tls-cert", "--internal-tls-key",
            "--internal-tls-ca", "--tls", "--tls-ca", "--tls-client-cert", "--tls-client-key",
            "--tls-server-name", "--api-key", "--api-key-file",
        ),
    ),
    "observability": (
        "metrics and traces",
        ("--metrics-port", "--trace-exporter", "--otlp-endpoint", "--trace-file"),
    ),
}  # fmt: skip

_CLIENT_SECURITY = SERVER_GROUPS["security"]

# The client and tool commands, whose flags mean other things (a bench's --seed is its workload's).
COMMAND_GROUPS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "generate": {
        "request": (
            "the server and the prompt",
            ("--target", "--chat", "--system", "--max-new-tokens", "--stop", "--ignore-eos", "--timeout"),
        ),
        "sampling": (
            "how tokens are chosen (unset: the model's defaults)",
            (
                "--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty",
                "--presence-penalty", "--frequency-penalty", "--seed",
            ),
        ),
        "security": _CLIENT_SECURITY,
    },
    "bench": {
        "workload": (
            "the server and the requests sent to it",
            (
                "--target", "--workload", "--prompt-min", "--prompt-max", "--output-mean", "--output-max",
                "--num-requests", "--seed", "--request-rate", "--burstiness", "--max-concurrency",
                "--timeout",
            ),
        ),
        "objectives": ("what goodput counts", ("--slo-ttft-ms", "--slo-tpot-ms", "--goodput")),
        "output": (
            "what is written and shown",
            ("--name", "--ready-file", "--out", "--no-progress", "--no-warmup"),
        ),
        "security": _CLIENT_SECURITY,
    },
    "check-comm": {
        "parallelism and devices": (
            "the group of ranks",
            ("--world-size", "--device", "--rank", "--dist-init"),
        ),
        "sweep": (
            "the all-reduces measured",
            ("--dtype", "--hidden-size", "--num-layers", "--max-num-seqs", "--iters", "--max-bytes", "--out"),
        ),
        "verdict": ("what passes", ("--step-limit-ms", "--link-limit-gbit")),
    },
}  # fmt: skip


def groups_of(command: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    return COMMAND_GROUPS.get(command, SERVER_GROUPS)


def long_flag(action: argparse.Action) -> str | None:
    return next((s for s in action.option_strings if s.startswith("--")), None)


def arrange(parser: argparse.ArgumentParser, command: str) -> None:
    """Moves each of parser's flags into its group, groups in table order, and drops the groups it
    empties (argparse's "options", security's own). Only the help's layout changes: parsing reads the
    parser's actions, not its groups."""
    groups = groups_of(command)
    title_of = {flag: title for title, (_, flags) in groups.items() for flag in flags}
    old = [g for g in parser._action_groups if g is not parser._positionals]
    present = {title_of.get(long_flag(a)) for g in old for a in g._group_actions}
    made = {
        title: parser.add_argument_group(title, description)
        for title, (description, _) in groups.items()
        if title in present
    }
    for group in old:
        for action in list(group._group_actions):
            title = title_of.get(long_flag(action))
            if title is not None:
                group._group_actions.remove(action)
                made[title]._group_actions.append(action)
        if not group._group_actions and group is not parser._optionals:
            parser._action_groups.remove(group)
