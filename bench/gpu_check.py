"""The GPU check that fits one device lease (one 10-minute command): the Triton attention backend and
the decode CUDA graphs against their references, their speed, then correctness against transformers and
the benchmark at Llama-3-8B shapes, with graphs on and off.

On the device machine (CUDA torch, transformers; no registry), from the repository root, after carrying
the wheels it lacks (`make gpu-check-wheels` here puts them in .whl/) and the generated stubs
(common/pb/tpserve):

    bash bench/gpu_check.sh            # installs .whl/ into /tmp/site, then runs this with --device cuda

Each part writes its figures to --out (JSON) as it finishes, so a lease that ends early keeps what ran;
a part that would start past --budget-s is skipped and says so. In order:
1. attention, graphs, decode_timing (bench/gpu_parts.py, each in a process of its own): the Triton backend
   against the reference in float16/bfloat16/float32 on random steps; every graph bucket's padded replay
   against the eager step, with both step times, at Llama-3-8B shapes; one layer's decode attention,
   Triton against the per-sequence reference and flex where it runs.
2. reference: a random Llama checkpoint (the `small` preset) served in bf16 on CUDA, with graphs and with
   --enforce-eager; greedy outputs of 8 prompts against transformers' generate on the same directory, in
   the same dtype, with the logprob tolerance vLLM's tests use (check_logprobs_close): tokens equal, or
   at the first divergence each side's token among the other's top-5, and the comparison ends there;
   and how many prompts equal token for token ("equal": all of them in the CPU float32 run, where the
   arithmetic is transformers').
3. benchmark, with graphs and with --enforce-eager: a Llama-3-8B-shaped model (--load-format dummy,
   config.json alone) at --gpu-memory-utilization 0.85: the mixed workload (prompts 50..1024 prefilled
   in chunks beside decodes) in a burst of 2 x max_num_seqs requests, continuous and then static
   batching; TTFT/TPOT percentiles, throughput, the ratio, the peak device memory the worker reports;
   and 64 requests decoding side by side (prompts of 128, 128 new tokens): TPOT p99 at batch 64 against
   the 20 ms target (tpot_p99_batch64).
4. quant, quant_reference, quant_stack (bench/gpu_quant.py): int4 and int8 through the Triton
   weight-only kernel and fp8 through torch._scaled_mm at a Llama-3-8B layer's shapes, each product's
   error against the dequantized weight's and the layer's time at batch 1 and 64 against bf16 (CUDA
   graphs); the `small` model served with --quantization int8 and fp8 against transformers on the same
   model quantized and dequantized offline; decode tokens/s through the stack at batch 1 and 64 for an
   8-layer Llama-3-8B-shaped model, dense and as int4 / int8 / fp8 compressed-tensors checkpoints with
   dummy weights. Each is skipped when less than MIN_SECONDS is left of --budget-s (`--parts
   quant,quant_reference,quant_stack` runs only them, in a lease of their own).

`--device cpu --quick` runs the same code at toy sizes (the tiny preset, a tiny dummy config, a few
requests; the Triton parts under TRITON_INTERPRET=1, set for their processes): tests/e2e/test_gpu_check.py
runs it in `make test`, so what the lease runs is tested here. On CPU there are no graphs, so the
--enforce-eager runs, which would repeat the others, are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.gpu_quant import served_check, stack_check
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
# TPOT at batch 64 (decode-bound: every request's 128 tokens side by side), against DESIGN's target.
DECODE_64 = WorkloadSpec("decode-64", 128, 128, output_mean=128, output_max=128, output_min=128)
DECODE_QUICK = WorkloadSpec("decode-8", 16, 16, output_mean=8, output_max=8, output_min=8)
TPOT_TARGET_MS = 20.0
# Graphs are the default on CUDA; --enforce-eager is the comparison.
VARIANTS = {"graphs": (), "eager": ("--enforce-eager",)}
IN_PROCESS_PARTS = ("attention", "graphs", "decode_timing", "quant")
# Seconds a part needs at full size (on a GPU): it is skipped, and says so, when fewer are left.
MIN_SECONDS = {"quant": 60, "quant_reference": 150, "quant_stack": 300}


def check_logprobs_close(ours: list[tuple[int, dict[int, float]]], ref: list[tuple[int, dict[int, float]]]):
    """vLLM's rule: (matched all, position of the first divergence or None). Each list holds, per
    position, the chosen token and its top alternatives {token: logprob}."""
    for i, ((a, a_top), (b, b_top)) in enumerate(zip(ours, ref, strict=False)):
        if a == b:
            continue
        return (a in b_top and b in a_top), i
    return True, None


def variants(a: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The graph settings to run the end-to-end parts with: on CPU only the default (no graphs there)."""
    return VARIANTS if a.device == "cuda" else {"graphs": VARIANTS["graphs"]}


def reference_check(a: argparse.Namespace, work: Path, result: dict, out: Path) -> None:
    from shard_worker.model.builder import build_model

    model_dir = build_model("tiny" if a.quick else "small", work / "random")
    new_tokens = 8 if a.quick else 32
    prompts = [[(7 * i + 13 * j) % 900 + 3 for j in range(5 + 37 * i)] for i in range(8)]
    ref = transformers_greedy(a, model_dir, prompts, new_tokens)
    part = result["reference"] = {
        "model": "tiny" if a.quick else "small (random Llama, 8 layers, hidden 512)",
        "dtype": a.dtype,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
    }
    for variant, flags in variants(a).items():
        try:
            ours = served_greedy(a, model_dir, prompts, new_tokens, flags)
        except Exception as e:  # the other variant still runs
            part[variant] = {"error": f"{type(e).__name__}: {e}"}
            continue
        verdicts = [check_logprobs_close(mine, theirs) for mine, theirs in zip(ours, ref, strict=True)]
        part[variant] = {
            "close": sum(ok for ok, _ in verdicts),
            "equal": sum(at is None for _, at in verdicts),  # every token transformers' (exact dtypes)
            "first_divergence": [at for _, at in verdicts],
        }
        out.write_text(json.dumps(result, indent=2, default=str))


def served_greedy(a, model_dir: Path, prompts, new_tokens: int, flags: tuple[str, ...]) -> list:
    """Per prompt, per position: (our greedy token, its top-5 {token: logprob}), through the real stack."""
    import grpc

    from common.launcher import running_stack
    from common.pb.tpserve.v1 import generation_pb2 as pb
    from common.pb.tpserve.v1 import generation_pb2_grpc

    stack_flags = ("--device", a.device, "--dtype", a.dtype, *flags)
    with (
        running_stack(model_dir, *stack_flags, timeout_s=900) as (info, _),
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
    return ours


def transformers_greedy(a, model_dir: Path, prompts, new_tokens: int, bf16_inputs: bool = False) -> list:
    """The same, from transformers' generate on the same directory and device, in the same dtype.
    bf16_inputs: the projections' inputs rounded to bf16 for the product, as our CPU int8 and int4
    kernels take them (shard_worker/model/quant/kernels.py), the product back in the model's dtype."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    device = torch.device(a.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, a.dtype)).to(device).eval()
    for name, module in model.named_modules() if bf16_inputs else ():
        if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            w = module.weight.detach()
            module.forward = lambda x, w=w: F.linear(x.to(torch.bfloat16).to(w.dtype), w)
    model.generation_config.eos_token_id = None
    refs = []
    for ids in prompts:
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
        refs.append(ref)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the stacks that follow profile the device's free memory
    return refs


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
    model_dir = work / ("toy-dummy" if a.quick else "llama3-8b-dummy")
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TOY if a.quick else LLAMA3_8B))
    base = ["--load-format", "dummy", "--device", a.device, "--dtype", a.dtype, "--metrics-port", "0"]
    base += ["--gpu-memory-utilization", "0.85", "--max-model-len", "2048" if a.quick else "4096"]
    part = result["benchmark"] = {"model": "toy" if a.quick else "Llama-3-8B shapes (dummy weights)"}
    tpot = result["tpot_p99_batch64"] = {"target_ms": TPOT_TARGET_MS, "batch": 8 if a.quick else 64}
    for variant, flags in variants(a).items():
        runs = part[variant] = {}
        for batching in ("continuous", "static"):
            if remaining(a) < 60:
                runs[batching] = {"skipped": f"under a minute of --budget-s {a.budget_s} left"}
                continue
            try:  # one stack's failure (graphs on, say) must not cost the others their figures
                runs.update(bench_stack(a, model_dir, (*base, *flags, "--batching", batching), batching))
            except Exception as e:
                runs[batching] = {"error": f"{type(e).__name__}: {e}"}
            out.write_text(json.dumps(result, indent=2, default=str))
        if "decode" in runs:
            p99 = runs["decode"]["tpot_ms"]["p99"]
            tpot[variant] = {"p99_ms": p99, "meets_target": p99 < TPOT_TARGET_MS}
        c, s = (runs.get(b, {}).get("output_tokens_per_s") for b in ("continuous", "static"))
        runs["continuous_over_static"] = round(c / s, 2) if c and s else math.nan
        out.write_text(json.dumps(result, indent=2, default=str))


def bench_stack(a, model_dir: Path, flags: tuple[str, ...], batching: str) -> dict:
    """One stack: the mixed burst, then (continuous batching) the decode run at batch 64."""
    from bench.client_run import bench_server
    from common.launcher import running_stack

    runs = {}
    workloads = [(batching, MIXED_QUICK if a.quick else MIXED, 8 if a.quick else 2 * 128)]
    if batching == "continuous":
        workloads.append(("decode", DECODE_QUICK if a.quick else DECODE_64, 8 if a.quick else 64))
    with running_stack(model_dir, *flags, timeout_s=900) as (info, _):
        for name, spec, num_requests in workloads:
            start = time.monotonic()
            run, extra, _ = asyncio.run(
                bench_server(info["target"], spec, num_requests, name=name, progress=False, timeout_s=600)
            )
            runs[name] = {
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
    return runs


def in_process_part(name: str, a: argparse.Namespace, work: Path, result: dict, out: Path) -> None:
    """bench/gpu_parts.py's part `name` in its own process (the Triton parts interpreted on CPU)."""
    part_out = work / f"{name}.json"
    cmd = [sys.executable, "-m", "bench.gpu_parts", name, "--device", a.device, "--dtype", a.dtype]
    cmd += ["--out", str(part_out), *(["--quick"] if a.quick else [])]
    env = dict(os.environ)
    if a.device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # read when the kernels are imported: the part's process only
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(30, remaining(a)))
    if proc.returncode != 0 or not part_out.exists():
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    result[name] = json.loads(part_out.read_text())


def skip_reason(name: str, device: str, left_s: float) -> str | None:
    """Why part `name` does not start with left_s seconds of the budget left (None: it starts). The
    MIN_SECONDS of the quantized parts are what they need on a GPU; at toy sizes on CPU only <= 0 skips."""
    needed = MIN_SECONDS.get(name, 0) if device == "cuda" else 0
    if left_s <= needed:
        return f"{max(0, round(left_s))} s of --budget-s left, {name} needs {needed}"
    return None


def remaining(a: argparse.Namespace) -> float:
    return a.budget_s - (time.monotonic() - a.started)


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
    p.add_argument("--budget-s", type=float, default=540.0, help="start no part past this many seconds")
    p.add_argument("--parts", default="", help="comma-separated parts to run (default: all, in order)")
    a = p.parse_args()
    if a.wheels:
        print(" ".join(carried_wheels()))
        return
    a.started = time.monotonic()
    out = Path(a.out)
    result: dict = {"device": a.device, "dtype": a.dtype, "quick": a.quick, "seconds": {}}
    parts = [(name, functools.partial(in_process_part, name)) for name in IN_PROCESS_PARTS[:3]]
    parts += [("reference", reference_check), ("benchmark", benchmark)]
    parts += [("quant", functools.partial(in_process_part, "quant")), ("quant_reference", served_check)]
    parts += [("quant_stack", stack_check)]
    chosen = [name for name in a.parts.split(",") if name] or [name for name, _ in parts]
    if unknown := set(chosen) - {name for name, _ in parts}:
        p.error(f"--parts: no part named {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="tpserve-gpu-check-") as tmp:
        for name, part in parts:
            t0 = time.monotonic()
            if name not in chosen:
                continue
            if reason := skip_reason(name, a.device, remaining(a)):
                result[name] = {"skipped": reason}
                continue
            try:
                part(a, Path(tmp), result, out)
            except Exception as e:  # a part that fails must not cost the others their figures
                result[name] = {**result.get(name, {}), "error": f"{type(e).__name__}: {e}"}
            result["seconds"][name] = round(time.monotonic() - t0, 1)
            out.write_text(json.dumps(result, indent=2, default=str))
    result["seconds"]["total"] = round(time.monotonic() - a.started, 1)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
