"""The async load generator: sends a workload to a running tpserve through the public API, streaming.

Each request is sent at its arrival time (or as soon as a --max-concurrency slot frees, vLLM's semantics:
the clock for TTFT starts when the request is actually sent), with greedy sampling and ignore_eos so its
output length is exactly the workload's. One grpc.aio channel carries every stream.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from tqdm import tqdm

from bench.metrics import RequestResult, details, engine_overhead_pct, latency_samples_ms, summarize
from bench.workload import BenchRequest, WorkloadSpec, build_requests
from common.pb.tpserve.v1 import generation_pb2, generation_pb2_grpc
from common.security import PLAINTEXT, ClientAuth

# Large prompts (mixed: up to 1024 ids) and many concurrent streams on one channel.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


async def get_model_info(
    target: str, timeout_s: float = 30.0, auth: ClientAuth = PLAINTEXT
) -> generation_pb2.ModelInfo:
    async with auth.aio_channel(target, CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await stub.GetModelInfo(
            generation_pb2.ModelInfoRequest(), timeout=timeout_s, wait_for_ready=True, metadata=auth.metadata
        )


def _request(req: BenchRequest, tag: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=f"bench-{tag}-{req.index}",
        token_ids=req.prompt_ids,
        max_new_tokens=req.max_new_tokens,
        sampling=generation_pb2.SamplingParams(temperature=0.0),
        ignore_eos=True,
    )


async def _one(stub, req: BenchRequest, tag: str, timeout_s: float | None, metadata=()) -> RequestResult:
    result = RequestResult(prompt_tokens=len(req.prompt_ids), send_time=time.perf_counter())
    try:
        async for resp in stub.Generate(_request(req, tag), timeout=timeout_s, metadata=metadata):
            if resp.token_ids:
                result.chunks.append((time.perf_counter(), len(resp.token_ids)))
        result.end_time = time.perf_counter()
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    return result


async def run_workload(
    target: str,
    requests: list[BenchRequest],
    *,
    max_concurrency: int | None = None,
    timeout_s: float | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    auth: ClientAuth = PLAINTEXT,
) -> list[RequestResult]:
    """Sends every request at its arrival offset from now; returns results in request order."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tag = f"{time.time_ns():x}"  # request ids stay unique if two benches share a server
    async with auth.aio_channel(target, CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await channel.channel_ready()
        start = time.perf_counter()

        async def scheduled(req: BenchRequest) -> RequestResult:
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                r = await _one(stub, req, tag, timeout_s, auth.metadata)
            else:
                async with semaphore:
                    r = await _one(stub, req, tag, timeout_s, auth.metadata)
            if on_done is not None:
                on_done(r)
            return r

        return list(await asyncio.gather(*(scheduled(r) for r in requests)))


async def warm_up(target: str, vocab_size: int, n: int = 2, auth: ClientAuth = PLAINTEXT) -> None:
    """A couple of short requests, so the first measured ones do not pay for lazy start-up work."""
    reqs = [BenchRequest(i, tuple(t % vocab_size for t in range(2, 18)), 4, 0.0) for i in range(n)]
    results = await run_workload(target, reqs, timeout_s=300, auth=auth)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


def read_peak_rss_mb(pids: dict[str, int]) -> dict[str, float]:
    """Each process's peak resident set (VmHWM) in MiB; a process that is gone is left out."""
    out = {}
    for name, pid in pids.items():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out[name] = int(line.split()[1]) / 1024.0
        except OSError:
            continue
    return out


def step_figures(before: generation_pb2.Stats, after: generation_pb2.Stats) -> dict:
    """What the engine did between two GetStats snapshots: mean batch size (sequences per step), tokens,
    step and forward time per step, and the share of the step spent outside the forward pass (scheduling,
    gRPC, applying results). The counters are cumulative, so earlier traffic (the warm-up) drops out."""
    steps = after.num_steps_total - before.num_steps_total
    if steps <= 0:
        return {"num_steps": 0, "mean_batch_size": None, "engine_overhead_pct": None}
    step_s = after.step_seconds_total - before.step_seconds_total
    forward_s = after.forward_seconds_total - before.forward_seconds_total
    return {
        "num_steps": steps,
        "mean_batch_size": (after.batched_seqs_total - before.batched_seqs_total) / steps,
        "mean_tokens_per_step": (after.batched_tokens_total - before.batched_tokens_total) / steps,
        "mean_step_ms": 1000.0 * step_s / steps,
        "mean_forward_ms": 1000.0 * forward_s / steps,
        "mean_allreduce_ms": 1000.0
        * (after.allreduce_seconds_total - before.allreduce_seconds_total)
        / steps,
        "engine_overhead_pct": engine_overhead_pct(step_s, forward_s),
        "preemptions": after.num_preemptions_total - before.num_preemptions_total,
    }


def speculation_figures(before: generation_pb2.Stats, after: generation_pb2.Stats) -> dict | None:
    """What speculative decoding did between two GetStats snapshots (None when it made no proposals):
    verifications, proposed and accepted tokens, the acceptance rate, the mean accepted length (tokens
    per verification, the target's own one included, as vLLM reports it) and the acceptance rate at
    each proposal position."""
    drafts = after.spec_num_drafts_total - before.spec_num_drafts_total
    if drafts <= 0:
        return None
    proposed = after.spec_num_draft_tokens_total - before.spec_num_draft_tokens_total
    accepted = after.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total
    emitted = after.spec_num_emitted_tokens_total - before.spec_num_emitted_tokens_total
    old = list(before.spec_accepted_per_position_total)
    per_position = [
        (n - (old[i] if i < len(old) else 0)) / drafts
        for i, n in enumerate(after.spec_accepted_per_position_total)
    ]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": emitted / drafts,
        "acceptance_per_position": per_position,
    }


async def get_stats(target: str, auth: ClientAuth = PLAINTEXT) -> generation_pb2.Stats | None:
    try:
        async with auth.aio_channel(target, CHANNEL_OPTIONS) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await stub.GetStats(generation_pb2.StatsRequest(), timeout=10, metadata=auth.metadata)
    except grpc.aio.AioRpcError:
        return None


async def bench_server(
    target: str,
    spec: WorkloadSpec,
    num_requests: int,
    *,
    name: str = "tpserve",
    seed: int = 0,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    pids: dict[str, int] | None = None,
    progress: bool = True,
    warmup: bool = True,
    timeout_s: float | None = None,
    auth: ClientAuth = PLAINTEXT,  # TLS and API key
) -> tuple[dict, dict, list[RequestResult]]:
    """Runs one workload against a server: (run object, details, per-request results)."""
    info = await get_model_info(target, auth=auth)
    requests = build_requests(
        spec,
        num_requests,
        vocab_size=info.vocab_size,
        seed=seed,
        request_rate=request_rate,
        burstiness=burstiness,
        max_model_len=info.max_model_len or None,
        exclude_ids=tuple(info.eos_token_ids),
    )
    if warmup:
        await warm_up(target, info.vocab_size, auth=auth)
    before = await get_stats(target, auth)
    bar = tqdm(total=len(requests), desc=name, unit="req", disable=not progress, leave=False)
    try:
        results = await run_workload(
            target,
            requests,
            max_concurrency=max_concurrency,
            timeout_s=timeout_s,
            on_done=lambda _: bar.update(),
            auth=auth,
        )
    finally:
        bar.close()
    after = await get_stats(target, auth)
    engine = step_figures(before, after) if before and after else {"mean_batch_size": None}
    engine.setdefault("engine_overhead_pct", None)
    speculation = speculation_figures(before, after) if before and after else None
    run = summarize(
        name,
        spec.name,
        results,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        peak_rss_mb=read_peak_rss_mb(pids or {}),
        mean_batch_size=engine["mean_batch_size"],
    )
    extra = details(results, [r.max_new_tokens for r in requests])
    extra["samples_ms"] = latency_samples_ms(results)
    extra["engine"] = engine
    extra["engine_overhead_pct"] = engine["engine_overhead_pct"]
    extra["speculation"] = speculation
    return run, extra, results
