"""The router process: wires the public APIs (gRPC, with reflection and health; the OpenAI-compatible HTTP
API when --http-port is set) to the shared request path (router/frontend.py) and the replicas
(router/pool.py), serves until SIGTERM, then drains."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import metrics, security, tracing
from common.grpc_util import check_ports_free, public_server_options, write_port_file
from common.pb.tpserve.v1 import generation_pb2, generation_pb2_grpc
from router import config as router_config
from router.auth import ApiKeyInterceptor, ApiKeys
from router.buckets import AdmissionQueue
from router.config import RouterConfig
from router.frontend import Frontend
from router.grpc_api import GenerationServicer
from router.metrics import RouterMetrics
from router.openai.server import OpenAIServer
from router.pool import SchedulerPool
from router.slo import SloEstimator
from router.tokenizer import Tokenizer

log = logging.getLogger("tpserve.router")

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def on_loop(loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0):
    """Runs a function on the loop from another thread (the metrics scrape) and waits for its result, so
    what it reads is one consistent state of the loop's objects."""

    def run(fn):
        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout_s)

    return run


async def serve(config: RouterConfig) -> None:
    ports = {"--port": config.port, "--metrics-port": config.metrics_port, "--http-port": config.http_port}
    check_ports_free(config.host, ports)  # before the gRPC server is up, so none is left half-started
    provider = tracing.setup(config.tracing, "router")
    admission = AdmissionQueue(config.admission)
    router_metrics = RouterMetrics(admission, on_loop=on_loop(asyncio.get_running_loop()))
    tokenizer = Tokenizer.from_pretrained(config.model)
    interceptors = []
    keys = None

    def refused() -> None:  # on either API
        router_metrics.failed.labels(code=grpc.StatusCode.UNAUTHENTICATED.name).inc()

    if config.api_key_file:
        keys = ApiKeys(security.read_api_keys(config.api_key_file))
        interceptors.append(ApiKeyInterceptor(keys, on_refused=refused))
        log.info("API keys required: %d loaded from %s", len(keys), config.api_key_file)
    # Room in gRPC core for a burst of new calls, so each one reaches the Frontend and gets a real answer.
    options = public_server_options(config.max_pending_calls)
    server = grpc.aio.server(options=options, interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    def on_ready(ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", GENERATION):
            asyncio.ensure_future(health_servicer.set(service, status))

    on_ready(False)
    pool = SchedulerPool(
        admission,
        config.routing_policy,
        on_ready,
        schedulers=config.schedulers,
        dns=config.scheduler_dns,
        dns_interval_s=config.dns_interval_s,
        retry_s=config.scheduler_retry_s,
        replica_wait_timeout_s=config.replica_wait_timeout_s,
        tls=config.internal_tls,
        slo=SloEstimator(config.slo),
    )
    router_metrics.watch_replicas(pool)
    pool.on_admit = lambda add, waited_s: router_metrics.queue_time.observe(waited_s)
    pool.on_failover = router_metrics.count_failover
    pool.on_resume = lambda request_id: router_metrics.resumed.inc()
    frontend = Frontend(config, tokenizer, pool, router_metrics)
    if config.priority_api_key_file:
        frontend.priority_keys = ApiKeys(
            security.read_api_keys(config.priority_api_key_file, "--priority-api-key-file")
        )
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(frontend), server)
    # Server reflection: grpcurl, Postman and evans work without the .proto files.
    reflection.enable_server_reflection((GENERATION, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = security.add_port(server, f"{config.host}:{config.port}", config.tls)
    await server.start()
    await pool.start()
    metrics_port = metrics.serve(router_metrics.registry, config.host, config.metrics_port)
    http, http_ports = None, {}
    if config.http_port is not None:
        # The same keys, TLS files and Frontend as gRPC; aiohttp runs in this event loop.
        http = OpenAIServer(
            frontend,
            keys=keys,
            on_refused=refused,
            tls=config.tls,
            drain_timeout_s=config.drain_timeout_s,
            metrics_registry=router_metrics.registry,  # /metrics on the HTTP port too, as vLLM serves it
            tool_call_parser=config.tool_call_parser,
            strict_schemas=config.disable_additional_properties,
            responses_store_size=config.responses_store_size,
        )
        http_ports["http_port"] = await http.start(config.host, config.http_port)
    write_port_file(config.port_file, port, metrics_port, **http_ports)
    mode = "plaintext" if config.tls is None else "TLS" if config.tls.ca is None else "mutual TLS"
    log.info("router serving tpserve.v1.Generation on %s:%d (%s)", config.host, port, mode)
    if metrics_port is not None:
        log.info("router metrics on http://%s:%d/metrics", config.host, metrics_port)
    if http is not None:
        scheme = "http" if config.tls is None else "https"
        log.info(
            "router OpenAI-compatible API on %s://%s:%d/v1", scheme, config.host, http_ports["http_port"]
        )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: probes see NOT_SERVING, new calls are refused (UNAVAILABLE), calls in flight may finish; those
    # still running at the drain timeout end with FINISH_REASON_ABORTED (a final message, not a cut).
    log.info("draining: up to %.0fs for requests in flight", config.drain_timeout_s)
    await health_servicer.enter_graceful_shutdown()
    grace = config.drain_timeout_s + 5.0  # beyond the drain: time for the aborted streams' last message
    stopping = asyncio.gather(server.stop(grace=grace), *([http.stop()] if http else []))
    await pool.drain(config.drain_timeout_s)
    await stopping
    await pool.close()
    tokenizer.close()
    await frontend.media.close()
    if provider is not None:
        provider.shutdown()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`tpserve router`'s flags (common/cli.py)."""
    router_config.add_arguments(p)


def main(a: argparse.Namespace) -> None:
    asyncio.run(serve(router_config.from_args(a)))
