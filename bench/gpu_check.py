"""The GPU check that fits one device lease: correctness against transformers on CUDA, the worst step at
--gpu-memory-utilization 0.85 without running out of memory, and the benchmark at Llama-3-8B shapes.

On the device machine (CUDA torch, transformers; no registry), from the repository root, after carrying
the wheels it lacks (`make gpu-check-wheels` here puts them in .whl/) and the generated stubs
(common/pb/tpserve):

    bash bench/gpu_check.sh            # installs .whl/ into /tmp/site, then runs this with --device cuda

Each part writes its figures to --out (JSON) as it finishes, so a lease that ends early keeps what ran:
1. reference: a random Llama checkpoint (the `small` preset) served in bf16 on CUDA; greedy outputs of
   8 prompts against transformers' generate on the same directory, in the same dtype, with the logprob
   tolerance vLLM's tests use (check_logprobs_close): tokens equal, or at the first divergence each
   side's token among the other's top-5, and the comparison ends there.
2. worst step and benchmark: a Llama-3-8B-shaped model (--load-format dummy, config.json alone) at
   --gpu-memory-utilization 0.85: the mixed workload (prompts 50..1024 prefilled in chunks beside
   decodes) in a burst of 2 x max_num_seqs requests, continuous and then static batching; TTFT/TPOT
   percentiles, throughput, the ratio, the peak device memory the worker reports.

`--device cpu --quick` runs the same code at toy sizes (the tiny preset, a tiny dummy config, a few
requests): tests/e2e/test_gpu_check.py runs it in `make test`, so what the lease runs is tested here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.workload import WorkloadSpec

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# The quick (CPU) stand-in: the same architecture at toy size.
TOY = {**LLAMA3_8B, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TOY.update(
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1
)

MIXED = WorkloadSpec("mixed", prompt_min=50, prompt_max=1024, output_mean=96, output_max=256)
MIXED_QUICK = WorkloadSpec("mixed-quick", prompt_min=8, prompt_max=64, output_mean=6, output_max=12)


def check_logprobs_close(ours: list[tuple[int, dict[int, float]]], ref: list[tuple[int, dict[int, float]]]):
    """vLLM's rule: (matched all, position of the first divergence or None). Each list holds, per
    position, the chosen token and its top alternatives {token: logprob}."""
    for i, ((a, a_top), (b, b_top)) in enumerate(zip(ours, ref, strict=False)):
        if a == b:
            continue
        return (a in b_top and b in a_top), i
    return True, None


def reference_check(a: argparse.Namespace, work: Path, result: dict) -> None:
    import grpc
    import torch
    from transformers import AutoModelForCausalLM

    from common.launcher import running_stack
    from common.pb.tpserve.v1 import generation_pb2 as pb
    from common.pb.tpserve.v1 import generation_pb2_grpc
    from shard_worker.model.builder import build_model

    model_dir = build_model("tiny" if a.quick else "small", work / "random")
    new_tokens = 8 if a.quick else 32
    prompts = [[(7 * i + 13 * j) % 900 + 3 for j in range(5 + 37 * i)] for i in range(8)]
    flags = ("--device", a.device, "--dtype", a.dtype)
    with (
        running_stack(model_dir, *flags, timeout_s=900) as (info, _),
        grpc.insecure_channel(info["target"]) as ch,
    ):
        stub = generation_pb2_grpc.GenerationStub(ch)
        ours = []
        for ids in prompts:
            req = pb.GenerateRequest(
                token_ids=ids, max_new_tokens=new_tokens, ignore_eos=True, top_logprobs=5
            )
            req.sampling.temperature = 0.0
            steps = []
            for resp in stub.Generate(req, timeout=300):
                for tok, lp in zip(resp.token_ids, resp.logprobs, strict=True):
                    steps.append((tok, {t.token_id: t.logprob for t in lp.top}))
            ours.append(steps)
    device = torch.device(a.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, a.dtype)).to(device).eval()
    model.generation_config.eos_token_id = None
    matched, first_divergence = 0, []
    for ids, mine in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids], device=device),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        ref = []
        for tok, scores in zip(out.sequences[0, len(ids) :].tolist(), out.scores, strict=True):
            lps = torch.log_softmax(scores[0].float(), dim=-1)
            values, top = lps.topk(5)
            ref.append((tok, dict(zip(top.tolist(), values.tolist(), strict=True))))
        ok, at = check_logprobs_close(mine, ref)
        matched += ok
        first_divergence.append(at)
    result["reference"] = {
        "model": "tiny" if a.quick else "small (random Llama, 8 layers, hidden 512)",
        "dtype": a.dtype,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "close": matched,
        "first_divergence": first_divergence,
    }


def peak_device_memory(metrics_ports: dict[str, int]) -> dict[str, float]:
    """Each worker's reported device memory in GiB (tpserve_device_memory_used_bytes), read now."""
    out = {}
    for name, port in metrics_ports.items():
        if not name.startswith("shard-worker"):
            continue
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith("tpserve_device_memory_used_bytes"):
                out[name] = round(float(line.split()[-1]) / 2**30, 2)
    return out


def benchmark(a: argparse.Namespace, work: Path, result: dict, out: Path) -> None:
    from bench.client_run import bench_server
    from common.launcher import running_stack

    model_dir = work / ("toy-dummy" if a.quick else "llama3-8b-dummy")
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TOY if a.quick else LLAMA3_8B))
    spec = MIXED_QUICK if a.quick else MIXED
    num_requests = 8 if a.quick else 2 * 128
    base = ["--load-format", "dummy", "--device", a.device, "--dtype", a.dtype, "--metrics-port", "0"]
    base += ["--gpu-memory-utilization", "0.85", "--max-model-len", "2048" if a.quick else "4096"]
    runs = {}
    for batching in ("continuous", "static"):
        flags = (*base, "--batching", batching)
        with running_stack(model_dir, *flags, timeout_s=900) as (info, _):
            start = time.monotonic()
            run, extra, results = asyncio.run(
                bench_server(info["target"], spec, num_requests, name=batching, progress=False, timeout_s=600)
            )
            runs[batching] = {
                "ok": extra["completed"],
                "failed": extra["failed"],
                "errors": extra["errors"][:5],
                "output_tokens_per_s": run["output_tokens_per_s"],
                "ttft_ms": run["ttft_ms"],
                "tpot_ms": run["tpot_ms"],
                "mean_batch_size": run.get("mean_batch_size"),
                "engine_overhead_pct": extra.get("engine_overhead_pct"),
                "device_memory_gib": peak_device_memory(info["metrics_ports"]),
                "wall_s": round(time.monotonic() - start, 1),
            }
        result["benchmark"] = {"model": "toy" if a.quick else "Llama-3-8B shapes (dummy weights)", **runs}
        out.write_text(json.dumps(result, indent=2, default=str))
    c, s = runs["continuous"]["output_tokens_per_s"], runs["static"]["output_tokens_per_s"]
    result["benchmark"]["continuous_over_static"] = round(c / s, 2) if s else math.nan


# What the device image lacks (its own list: KINDS.md), pinned to the versions installed here, so the
# generated stubs meet the grpcio and protobuf runtimes they were generated for.
CARRIED = (
    "grpcio",
    "protobuf",
    "grpcio-health-checking",
    "grpcio-reflection",
    "grpcio-status",
    "googleapis-common-protos",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-semantic-conventions",
)


def carried_wheels() -> list[str]:
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in CARRIED]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", action="store_true", help="print the pinned packages to carry, and exit")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--quick", action="store_true", help="toy sizes (what make test runs on CPU)")
    p.add_argument("--out", default="gpu-check.json")
    a = p.parse_args()
    if a.wheels:
        print(" ".join(carried_wheels()))
        return
    out = Path(a.out)
    result: dict = {"device": a.device, "dtype": a.dtype, "quick": a.quick}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpserve-gpu-check-") as tmp:
        for name, part in (("reference", reference_check), ("benchmark", benchmark)):
            t0 = time.monotonic()
            try:
                part(a, Path(tmp), result, out) if part is benchmark else part(a, Path(tmp), result)
            except Exception as e:  # a part that fails must not cost the others their figures
                result[name] = {"error": f"{type(e).__name__}: {e}"}
            result.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 1)
            out.write_text(json.dumps(result, indent=2, default=str))
    result["seconds"]["total"] = round(time.monotonic() - started, 1)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
