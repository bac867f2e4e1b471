"""The router's configuration: built once from the command line, validated, frozen.

Each field declared with `setting` is also the flag of the same name (common/settings.py); those marked
launch=True are taken by `tpserve launch` too and passed through. The admission queue's and the replica
choice's knobs are declared by their own policies (router/buckets.py, router/replicas.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from common import gguf_model, metrics, security, settings, tracing
from common.security import TlsFiles
from common.settings import above, at_least, nested, setting
from common.tracing import TracingConfig
from router.buckets import AdmissionPolicy
from router.media.policy import MediaPolicy
from router.openai.tool_parsers import PARSERS as TOOL_PARSERS
from router.reasoning import NAMES as REASONING_PARSERS
from router.replicas import RoutingPolicy
from router.slo import SloPolicy


@dataclass(frozen=True)
class RouterConfig:
    model: str = setting(
        help="checkpoint directory (for the tokenizer and chat template), or a .gguf file", launch=True
    )
    tokenizer: str | None = setting(
        None, help="with a .gguf --model: the tokenizer's directory (default: the file's own)", launch=True
    )
    # LoRA adapters the replicas serve, each a `model` name of its own (the router needs only the names).
    enable_lora: bool = setting(False, help="serve LoRA adapters (--lora-modules)", launch=True)
    lora_modules: tuple[str, ...] = setting((), help="a LoRA adapter to serve, NAME=PATH", launch=True)
    # The replicas: schedulers' HOST:PORT, or a NAME:PORT whose addresses are the schedulers (a
    # Kubernetes headless Service), re-resolved every dns_interval_s. One of the two.
    schedulers: tuple[str, ...] = setting(
        (), flag="--scheduler", help="HOST:PORT of a replica's scheduler (repeatable: one per replica)"
    )
    scheduler_dns: str | None = setting(
        None,
        help="NAME:PORT whose addresses are the schedulers (a headless Service), re-resolved periodically",
    )
    dns_interval_s: float = setting(
        5.0, flag="--scheduler-dns-interval-s", help="how often --scheduler-dns is resolved", rule=above(0)
    )
    host: str = setting("127.0.0.1", help="address to bind; 0.0.0.0 to serve other hosts", launch=True)
    port: int = setting(50051, help="0: any free port (see --port-file)", rule=at_least(0), launch=True)
    port_file: str | None = setting(None, help="write the bound port here once serving")
    http_port: int | None = setting(
        None,
        help="also serve the HTTP APIs (OpenAI's /v1/completions, /v1/chat/completions, /v1/responses; "
        "Anthropic's /v1/messages) on this port, same host, keys and TLS (0: any free port; unset: no HTTP)",
        rule=at_least(0),
        launch=True,
    )
    scheduler_retry_s: float = setting(
        0.5, help="pause before reconnecting to a scheduler whose stream broke", rule=above(0)
    )
    drain_timeout_s: float = setting(
        30.0, help="on SIGTERM, how long requests in flight may finish", rule=at_least(0), launch=True
    )
    max_prompt_tokens: int = setting(
        0, help="longest prompt accepted (0: max_model_len - 1)", rule=at_least(0), launch=True
    )
    max_new_tokens_limit: int = setting(
        0,
        help="largest max_new_tokens accepted (0: whatever fits in max_model_len)",
        rule=at_least(0),
        launch=True,
    )
    default_max_new_tokens: int = setting(
        256,
        help="max_new_tokens of a request that leaves it unset (lowered to fit max_model_len)",
        rule=at_least(1),
        launch=True,
    )
    replica_wait_timeout_s: float = setting(
        60.0,
        help="while no replica is up (a scheduler restarting), requests wait this long for one, then get "
        "UNAVAILABLE",
        rule=above(0),
        launch=True,
    )
    # Not the admission bound (--max-queued-requests is): the room gRPC core gives a burst of new calls
    # until the router's event loop has taken each one and can answer it (common/grpc_util.py).
    max_pending_calls: int = setting(
        16384,
        help="new gRPC calls held for the router while it takes earlier ones (a burst); past that gRPC "
        "cancels them (CANCELLED), so keep it above the largest burst clients send (~12 KB each)",
        rule=at_least(1),
        launch=True,
    )
    tool_call_parser: str | None = setting(
        None,
        help="the format of the model's tool calls, parsed out of chat answers when tool_choice is auto "
        "(vLLM's names; unset: tool_choice auto is refused)",
        choices=tuple(TOOL_PARSERS),
        launch=True,
    )
    reasoning_parser: str | None = setting(
        None,
        help="split a reasoning model's chat answers into reasoning and content (vLLM's names: qwen3, "
        "deepseek_r1); tool calls and structured outputs then apply to the content after the think block",
        choices=REASONING_PARSERS,
        launch=True,
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        help="the model's names in the API (vLLM's flag, one or more): the first is reported, any is "
        "accepted as `model` [the checkpoint directory's name]",
        launch=True,
    )
    # vLLM's structured_outputs_config key of the same name (there: its guidance backend's switch to
    # xgrammar's strict mode); true here by default, as xgrammar, vLLM's default backend, compiles schemas.
    disable_additional_properties: bool = setting(
        True,
        help="JSON Schemas (response_format, structured_outputs, guided_json, forced tool calls' parameters) "
        "admit no properties or items beyond those they name unless they set additionalProperties; "
        "--no-disable-additional-properties: JSON Schema's open objects (a request's "
        "structured_outputs.disable_additional_properties still decides for it)",
        launch=True,
    )
    # The Responses API's `store`: kept in this router's memory only, lost on restart.
    responses_store_size: int = setting(
        1000,
        help="stored responses (POST /v1/responses with store) kept for GET and previous_response_id, least "
        "recently used out first; in memory, lost on restart (0: none kept)",
        rule=at_least(0),
        launch=True,
    )
    admission: AdmissionPolicy = nested(AdmissionPolicy)
    media: MediaPolicy = nested(MediaPolicy)
    routing: RoutingPolicy = nested(RoutingPolicy)
    slo: SloPolicy = nested(SloPolicy)
    # Keys clients must send as `authorization: Bearer <key>`; read in serve(), so never held here.
    api_key_file: str | None = setting(
        None,
        help="require `authorization: Bearer <key>` with a key from this file (one a line, # comments)",
        launch=True,
    )
    # Keys whose callers may ask a priority below the default (router/objectives.py); read in serve().
    priority_api_key_file: str | None = setting(
        None,
        help="only callers presenting `authorization: Bearer <key>` with a key from this file (one a "
        "line) may ask a priority below 0 (served first, preempting); others get PERMISSION_DENIED "
        "(HTTP 403). Without it any caller may",
        launch=True,
    )
    metrics_port: int | None = None
    tracing: TracingConfig = TracingConfig()
    tls: TlsFiles | None = None  # the public port; tls.ca set: clients must present certificates
    internal_tls: TlsFiles | None = None  # mutual TLS to the scheduler

    def __post_init__(self):
        settings.validate(self)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        # A .gguf file becomes a directory of its config and tokenizer (common/gguf_model.py).
        object.__setattr__(self, "model", gguf_model.model_dir(self.model, self.tokenizer))
        if bool(self.schedulers) == bool(self.scheduler_dns):
            raise ValueError("give --scheduler (repeatable) or --scheduler-dns, not both and not neither")
        for target in (*self.schedulers, *([self.scheduler_dns] if self.scheduler_dns else [])):
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--scheduler and --scheduler-dns take HOST:PORT, got {target!r}")
        self.slo.check(len(self.admission.bucket_edges) + 1)
        if len(set(self.schedulers)) != len(self.schedulers):
            raise ValueError(f"--scheduler given twice for the same address: {self.schedulers}")

    @property
    def routing_policy(self) -> RoutingPolicy:
        """Routing with the short-prompt edge at the first length bucket (no buckets: the default)."""
        edges = self.admission.bucket_edges
        return replace(self.routing, short_edge=edges[0]) if edges else self.routing


def add_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_arguments(p, RouterConfig)
    security.add_public_arguments(p)
    security.add_internal_arguments(p)
    metrics.add_arguments(p)
    tracing.add_arguments(p)


def from_args(a: argparse.Namespace) -> RouterConfig:
    return settings.from_args(
        RouterConfig,
        a,
        metrics_port=a.metrics_port,
        tracing=tracing.from_args(a),
        tls=security.public_from_args(a),
        internal_tls=security.internal_from_args(a),
    )
