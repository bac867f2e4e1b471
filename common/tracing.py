"""OpenTelemetry tracing for every process: set-up from flags, and context carried across our streams.

With no exporter (the default) no SDK tracer provider is installed, so every span is the API's
non-recording span and the hot path pays a function call, not a span. Context travels in gRPC metadata
on the public API (W3C traceparent, so a client's trace continues into ours) and in a string map on
internal stream messages, where there is no per-request call to put metadata on.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject

EXPORTERS = ("none", "console", "otlp")


@dataclass(frozen=True)
class TracingConfig:
    exporter: str = "none"
    otlp_endpoint: str = ""
    trace_file: str = ""  # console exporter into this file, one JSON span per line

    def __post_init__(self):
        if self.exporter not in EXPORTERS:
            raise ValueError(f"--trace-exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace-exporter",
        choices=EXPORTERS,
        default=None,
        help="none (default), console or otlp; OTEL_TRACES_EXPORTER is used when this is not given",
    )
    p.add_argument("--otlp-endpoint", default="", help="OTLP gRPC collector HOST:PORT (implies otlp)")
    p.add_argument("--trace-file", default="", help="write spans as JSON lines to this file")


def from_args(a: argparse.Namespace) -> TracingConfig:
    """Flags win over the SDK's environment variables; the variables work as SDK users expect."""
    exporter = a.trace_exporter
    if exporter is None:
        exporter = "otlp" if a.otlp_endpoint else os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",")[0]
        exporter = exporter if exporter in EXPORTERS else "none"
    if a.trace_file and exporter == "none":
        exporter = "console"
    return TracingConfig(exporter=exporter, otlp_endpoint=a.otlp_endpoint, trace_file=a.trace_file)


def flags(config: TracingConfig) -> list[str]:
    """The same settings as command-line flags, for the launcher to pass to its children."""
    out = ["--trace-exporter", config.exporter]
    if config.otlp_endpoint:
        out += ["--otlp-endpoint", config.otlp_endpoint]
    if config.trace_file:
        out += ["--trace-file", config.trace_file]
    return out


def setup(config: TracingConfig, service_name: str):
    """Installs the SDK provider for this process; returns it (to flush at exit) or None."""
    if config.exporter == "none":
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # OTEL_SERVICE_NAME, when set, names every process alike; otherwise each names its role.
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    if config.exporter == "console" and config.trace_file:
        out = open(config.trace_file, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
        exporter = ConsoleSpanExporter(
            service_name=service_name, out=out, formatter=lambda span: span.to_json(indent=None) + "\n"
        )
    elif config.exporter == "console":
        exporter = ConsoleSpanExporter(service_name=service_name)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        kwargs = {"endpoint": config.otlp_endpoint, "insecure": True} if config.otlp_endpoint else {}
        exporter = OTLPSpanExporter(**kwargs)
    # Batched: exporting never happens on the step loop.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from_metadata(metadata) -> otel_context.Context:
    """The caller's trace context from gRPC invocation metadata (traceparent, tracestate)."""
    return extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})


def carrier(span: trace.Span | None = None) -> dict[str, str]:
    """A span's context as a string map for an internal message; empty when not recording."""
    if span is None or not span.is_recording():
        return {}
    out: dict[str, str] = {}
    inject(out, context=trace.set_span_in_context(span))
    return out


def context_from_carrier(carrier_map) -> otel_context.Context | None:
    return extract(dict(carrier_map)) if carrier_map else None
