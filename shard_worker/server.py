"""The shard worker process: the device and dtype it runs on, the model loaded into one ModelRunner, and
the gRPC server around its servicer (shard_worker/servicer.py), health and metrics; a rank that fails
leaves, so that its group is rebuilt."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import metrics, security, tracing
from common.grpc_util import SERVER_OPTIONS, check_ports_free, write_port_file
from common.pb.tpserve.internal.v1 import worker_pb2_grpc
from shard_worker import config as worker_config
from shard_worker import devices
from shard_worker.attention.kv_dtype import kv_cache_dtype
from shard_worker.config import WorkerConfig
from shard_worker.metrics import WorkerMetrics
from shard_worker.servicer import ShardWorkerServicer
from shard_worker.startup import StartupPhases, configure_compile_cache

log = logging.getLogger("tpserve.shard_worker")


def select_device(config: WorkerConfig, dtype: str) -> torch.device:
    """This rank's device, set as current; ValueError when this machine cannot give it (devices.py)."""
    if config.device == "cpu":
        # Randomly initialised weights produce denormals that slow CPU matmuls 10-30x.
        torch.set_flush_denormal(True)
        return torch.device("cpu")
    count = torch.cuda.device_count()
    devices.check_cuda_devices(1, count)
    device = torch.device("cuda", devices.cuda_index(config.rank, count))
    try:
        torch.cuda.set_device(device)
    except RuntimeError as e:  # a driver older than this torch, a GPU in exclusive use elsewhere, ...
        raise ValueError(f"--device cuda: cannot use {device}: {str(e).strip().splitlines()[0]}") from None
    devices.check_dtype("cuda", dtype, torch.cuda.is_bf16_supported(including_emulation=False))
    return device


def resolve_dtype(config: WorkerConfig) -> tuple[str, str]:
    """--dtype, with auto resolved for this machine, and why (devices.model_dtype)."""
    cuda_bf16 = (
        config.dtype == "auto"
        and config.device == "cuda"
        and torch.cuda.is_bf16_supported(including_emulation=False)
    )
    return devices.model_dtype(config.dtype, config.device, devices.cpu_flags(), cuda_bf16)


def serve(config: WorkerConfig) -> None:
    from common.pooling import resolve_runner
    from shard_worker.model_runner import ModelRunner

    # Before the model loads, which can take minutes: a taken port fails at once.
    check_ports_free(config.host, {"--port": config.port, "--metrics-port": config.metrics_port})
    provider = tracing.setup(config.tracing, f"shard-worker-{config.rank}")
    from shard_worker.parallel import init_tensor_parallel

    torch.set_num_threads(config.threads)
    cache_dir = configure_compile_cache(config.compile_cache_dir)  # before anything compiles
    dtype, why = resolve_dtype(config)
    device = select_device(config, dtype)
    tp = init_tensor_parallel(config.rank, config.world_size, config.dist_init, device)
    linear = devices.linear_dtype(config.linear_dtype, dtype)
    phases = StartupPhases(config.rank, cache_dir)
    with phases.phase("load_weights"):
        runner = ModelRunner(
            config.model,
            getattr(torch, dtype),
            device,
            tp,
            config.load_format,
            config.attention_backend,
            cuda_graphs=config.use_cuda_graphs,
            speculative_model=config.speculative_model,
            linear_dtype=None if linear is None else getattr(torch, linear),
            quantization=config.quantization,
            kv_cache_dtype=kv_cache_dtype(config.kv_cache_dtype, getattr(torch, dtype)),
            warm_kernels=True,
            lora=(config.lora_modules, config.max_lora_rank, config.max_loras, config.max_cpu_loras)
            if config.enable_lora
            else None,
            runner=resolve_runner(config.runner, config.model),
        )
    # After the model loaded: a refusal is the only line a failed start writes.
    if config.dtype == "auto":
        log.info("rank %d: --dtype auto is %s: %s", config.rank, dtype, why)
    if linear is not None:
        log.info(
            "rank %d: linear layers' weights in %s (--linear-dtype %s)",
            config.rank,
            linear,
            config.linear_dtype,
        )

    stop = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    worker_metrics = WorkerMetrics(device, config.rank)
    if runner.encoder_cache is not None:
        worker_metrics.watch_encoder_cache(runner.encoder_cache)
    servicer = ShardWorkerServicer(runner, config, worker_metrics, phases)
    worker_pb2_grpc.add_ShardWorkerServicer_to_server(servicer, server)
    # Standard health (Kubernetes probes): the server starts only once the process group is up and
    # this rank's shard is loaded, so it is SERVING from the first probe; a failed step flips it.
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    failure: list[str] = []

    def on_failure(reason: str) -> None:
        # The rank cannot be trusted any more (its process group may be broken: a peer died mid-collective):
        # it leaves, non-zero, so the launcher or Kubernetes rebuilds the group. A stream that merely ended
        # is not a failure: a scheduler that reconnects finds the rank SERVING.
        log.error("rank %d: %s; exiting so that the group is rebuilt", config.rank, reason)
        failure.append(reason)
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        stop.set()

    servicer.on_failure = on_failure
    port = security.add_port(server, f"{config.host}:{config.port}", config.internal_tls)
    server.start()
    metrics_port = metrics.serve(worker_metrics.registry, config.host, config.metrics_port)
    write_port_file(config.port_file, port, metrics_port)
    log.info("shard worker rank %d/%d serving on %s:%d", config.rank, config.world_size, config.host, port)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1.0).wait()
    if provider is not None:
        provider.shutdown()
    if failure:
        print(f"tpserve shard-worker: rank {config.rank}: {failure[0]}", file=sys.stderr)
        sys.exit(1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`tpserve shard-worker`'s flags (common/cli.py)."""
    worker_config.add_arguments(p)


def main(a: argparse.Namespace) -> None:
    serve(worker_config.from_args(a))
