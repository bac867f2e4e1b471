"""The quantized parts of the GPU check (bench/gpu_check.py runs them after the others; each is skipped by
--budget-s when too little time is left):

- quant (in a process of its own, through bench/gpu_parts.py): one Llama-3-8B layer's four products
  (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) dense in bf16 (cuBLAS), int4
  weight-only (group 128 with zero points, the Triton kernel), int8 weight-only (the Triton kernel) and
  fp8 W8A8 (torch._scaled_mm, activations e4m3 per token): each product's largest error against the
  float32 product with the dequantized weight (for fp8, with x rounded by the same per-token rule), and
  the time of the layer's products at batch 1 and 64 over 8 layers of distinct weights (past the L2
  cache), replayed as one CUDA graph (as decode runs: no launch overhead), with the speed against dense.
- quant_reference: a random Llama (the `small` preset) served with --quantization int8 and fp8 against
  transformers' greedy generate on the same model quantized and dequantized offline by the same rule
  (bench/gpu_check.check_logprobs_close: on CUDA fp8 also rounds activations, which the reference does
  not, so tokens may part at a near-tie; the rule allows that once).

--quick (CPU, what tests/e2e/test_gpu_check.py runs): toy shapes, one layer, batch 1 and 8, timed once;
the Triton kernel under TRITON_INTERPRET=1 (gpu_check sets it for the part's process) and fp8 through
torch's CPU _scaled_mm; the served parts on the tiny preset and the toy config, one stack each (int8;
int4), with the CPU kernels (tests/unit/test_gpu_quant.py loads every stack format's config).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shard_worker.model.quant import kernels, products

LLAMA3_8B_LAYER = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096)]
LLAMA3_8B_LAYER.append(("down_proj", 4096, 14336))
TOY_LAYER = [("qkv_proj", 96, 64), ("o_proj", 64, 64), ("gate_up_proj", 256, 64), ("down_proj", 64, 128)]
GROUP, TOY_GROUP = 128, 32
# Against the float32 product with the dequantized weight: the bf16 rounding of x, of each dequantized
# int4 weight and of the output (the interpreter truncates to bf16, doubling it); fp8 writes bf16.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def _int4(w: torch.Tensor, group: int):
    """Asymmetric 4-bit in groups along K (AWQ's rule): scale (max - min) / 15, integer zeros."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return kernels.PackedInt4.pack(q, scale, zero, group)


class Layer:
    """One layer's products in each format, from the same random weights (in the run's dtype)."""

    def __init__(self, shapes, device, dtype, seed: int, group: int):
        gen = torch.Generator(device).manual_seed(seed)
        self.products = []
        for name, n, k in shapes:
            w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
            q8, s8 = products.quantize_int8(w)
            f8, fs = products.quantize_fp8(w, per_channel=True)
            int4, int8 = _int4(w, group), kernels.PackedInt8.pack(q8, s8)
            self.products.append(
                {"name": name, "k": k, "dense": w, "int4": int4, "int8": int8, "fp8": (f8, fs)}
            )
            del w

    @staticmethod
    def apply(fmt: str, p: dict, x: torch.Tensor) -> torch.Tensor:
        if fmt == "dense":  # unquantized, in the run's dtype (bf16 on the GPU)
            return F.linear(x, p["dense"])
        if fmt == "fp8" and x.device.type == "cpu":  # the call a Hopper makes, on torch's CPU fp8 GEMM
            return products.fp8_scaled_mm(x, *p["fp8"], None)
        if fmt == "fp8":  # _scaled_mm where the device has fp8, else dequantized
            return products.fp8_linear(x, *p["fp8"], None, dynamic_act=True)
        return p[fmt].matmul(x)

    @staticmethod
    def reference(fmt: str, p: dict, x: torch.Tensor) -> torch.Tensor:
        """float32, the dequantized weight (fp8: x rounded to e4m3 per token as the kernel's rule)."""
        x = x.float()
        if fmt == "dense":
            return F.linear(x, p["dense"].float())
        if fmt == "fp8":
            q, scale = p["fp8"]
            sx = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
            x = (x / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sx
            return F.linear(x, products.dequantize(q, scale, torch.float32))
        return F.linear(x, p[fmt].dequantize(torch.float32))


FORMATS = ("dense", "int4", "int8", "fp8")


def _time_ms(fn, device: torch.device, rounds: int) -> dict:
    """ms of one fn() call: on CUDA replayed as a CUDA graph (and eagerly, for the launch overhead); on
    CPU (the interpreter) once."""
    fn()  # compiles the Triton kernels, warms cuBLAS
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return {"eager_ms": round((time.perf_counter() - start) * 1e3, 3)}
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    torch.cuda.synchronize(device)
    eager = (time.perf_counter() - start) * 1e3 / rounds
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch's capture recipe says
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    begin.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return {"graph_ms": round(begin.elapsed_time(end) / rounds, 4), "eager_ms": round(eager, 4)}


def kernel_check(a: argparse.Namespace) -> dict:
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if device.type == "cpu":
        kernels.TRITON_DEVICES = ("cuda", "cpu")  # the interpreter runs the CUDA kernels on CPU tensors
    shapes, num_layers = (TOY_LAYER, 1) if a.quick else (LLAMA3_8B_LAYER, 8)
    batches, rounds = ((1, 8), 1) if a.quick else ((1, 64), 20)
    group = TOY_GROUP if a.quick else GROUP
    layers = [Layer(shapes, device, dtype, seed, group) for seed in range(num_layers)]
    first = layers[0].products
    fp8_path = "scaled_mm (torch's CPU build)" if device.type == "cpu" else "dequantize"
    if products.scaled_mm_serves(device.type, products._capability(device), shapes[0][1], shapes[0][2]):
        fp8_path = "scaled_mm"
    out = {
        "shapes": [f"{name} {n}x{k}" for name, n, k in shapes],
        "layers_timed": num_layers,
        "dtype": a.dtype,
        "kernels": {"dense": f"F.linear, {a.dtype}", "int4": first[0]["int4"].kernel,
                    "int8": first[0]["int8"].kernel, "fp8": fp8_path},
        "errors": {},
        "timing": {},
    }  # fmt: skip
    gen = torch.Generator(device).manual_seed(1)
    with torch.inference_mode():
        widths = sorted({p["k"] for p in first})
        xs = {
            m: {k: torch.randn(m, k, generator=gen, device=device).to(dtype) for k in widths} for m in batches
        }
        for fmt in FORMATS:
            worst = 0.0
            for p in first:
                x = xs[batches[-1]][p["k"]]
                want = Layer.reference(fmt, p, x)
                got = Layer.apply(fmt, p, x).float()
                worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
            # fp8's product is written in bfloat16 whatever x's dtype (fp8_scaled_mm).
            tol = max(TOLERANCE[dtype], 1e-2) if fmt == "fp8" else TOLERANCE[dtype]
            out["errors"][fmt] = {"max_rel_err": worst, "tol": tol, "ok": worst <= tol}
        for m in batches:
            row = out["timing"][f"batch {m}"] = {}
            for fmt in FORMATS:

                def step(fmt=fmt, x=xs[m]):
                    for layer in layers:
                        for p in layer.products:
                            Layer.apply(fmt, p, x[p["k"]])

                row[fmt] = _time_ms(step, device, rounds)
            key = "graph_ms" if device.type == "cuda" else "eager_ms"
            for fmt in FORMATS[1:]:
                row[f"{fmt}_speed_vs_dense"] = round(row["dense"][key] / row[fmt][key], 4)
    out["ok"] = all(e["ok"] for e in out["errors"].values())
    return out


def dequantized_copy(model_dir: Path, out: Path, rule: str, dtype: torch.dtype) -> Path:
    """The model with each linear layer's weight (not the LM head's) as --quantization `rule` quantizes
    it when served in dtype (its value in dtype, a scale per output row), dequantized to float32."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            w = w.to(dtype)
            q, scale = products.quantize_int8(w) if rule == "int8" else products.quantize_fp8(w, True)
            tensors[name] = products.dequantize(q, scale, torch.float32)
    shutil.copytree(model_dir, out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def served_check(a: argparse.Namespace, work: Path, result: dict, out: Path) -> None:
    from bench.gpu_check import check_logprobs_close, served_greedy, transformers_greedy
    from shard_worker.model.builder import build_model

    model_dir = build_model("tiny" if a.quick else "small", work / "quant-random")
    new_tokens = 8 if a.quick else 32
    prompts = [[(7 * i + 13 * j) % 900 + 3 for j in range(5 + 37 * i)] for i in range(2 if a.quick else 8)]
    part = result["quant_reference"] = {"prompts": len(prompts), "new_tokens": new_tokens, "dtype": a.dtype}
    for rule in ("int8",) if a.quick else ("int8", "fp8"):  # quick: one stack (on CPU both are CPU paths)
        try:
            reference = dequantized_copy(
                model_dir, work / f"dequantized-{rule}", rule, getattr(torch, a.dtype)
            )
            # On CPU our int8 kernel rounds its input to bf16: the reference does too, and is then exact.
            theirs = transformers_greedy(a, reference, prompts, new_tokens, bf16_inputs=a.device == "cpu")
            ours = served_greedy(a, model_dir, prompts, new_tokens, ("--quantization", rule))
        except Exception as e:  # the other rule still runs
            part[rule] = {"error": f"{type(e).__name__}: {e}"}
            continue
        verdicts = [check_logprobs_close(mine, ref) for mine, ref in zip(ours, theirs, strict=True)]
        part[rule] = {
            "close": sum(ok for ok, _ in verdicts),
            "equal": sum(at is None for _, at in verdicts),
            "first_divergence": [at for _, at in verdicts],
        }
        out.write_text(json.dumps(result, indent=2, default=str))


def _compressed_tensors(weights: dict, fmt: str, activations: dict | None = None) -> dict:
    """A compressed-tensors quantization_config: every Linear but the LM head in one scheme."""
    group = {
        "targets": ["Linear"],
        "weights": {"symmetric": True, "dynamic": False, **weights},
        "format": fmt,
    }
    if activations:
        group["input_activations"] = activations
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": group}}  # fmt: skip


def stack_formats(group: int) -> dict[str, dict | None]:
    """The checkpoints' quantization_config per format (None: dense, in --dtype)."""
    token_fp8 = {"type": "float", "num_bits": 8, "dynamic": True, "strategy": "token", "symmetric": True}
    return {
        "dense": None,
        "int4": _compressed_tensors(
            {"type": "int", "num_bits": 4, "strategy": "group", "group_size": group}, "pack-quantized"
        ),
        "int8": _compressed_tensors({"type": "int", "num_bits": 8, "strategy": "channel"}, "int-quantized"),
        "fp8": _compressed_tensors(
            {"type": "float", "num_bits": 8, "strategy": "channel"}, "float-quantized", token_fp8
        ),
    }


def stack_check(a: argparse.Namespace, work: Path, result: dict, out: Path) -> None:
    """Decode tokens/s through the stack at batch 1 and 64: a Llama-3-8B-shaped model of 8 layers with
    dummy weights, dense and as compressed-tensors W4A16 (group 128), W8A16 and FP8 W8A8 checkpoints
    (config.json alone: --load-format dummy fills each format's own tensors, random scales included, so
    the text is noise but every product runs its kernel). --quick: the toy config, int4 only (one stack:
    the same code; the dense toy stack is the benchmark part's)."""
    from bench.client_run import bench_server
    from bench.gpu_check import DECODE_64, DECODE_QUICK, LLAMA3_8B, TOY
    from common.launcher import running_stack

    config = dict(TOY) if a.quick else {**LLAMA3_8B, "num_hidden_layers": 8}
    formats = stack_formats(TOY_GROUP if a.quick else GROUP)
    names = ["int4"] if a.quick else list(formats)
    runs = [("batch 1", DECODE_QUICK if a.quick else DECODE_64, 1), ("batch 64", DECODE_64, 64)]
    if a.quick:
        runs = [("batch 1", DECODE_QUICK, 1), ("batch 4", DECODE_QUICK, 4)]
    part = result["quant_stack"] = {"model": "toy" if a.quick else "Llama-3-8B shapes, 8 layers, dummy"}
    for name in names:
        model_dir = work / f"stack-{name}"
        model_dir.mkdir(parents=True, exist_ok=True)
        quantization = formats[name]
        (model_dir / "config.json").write_text(
            json.dumps({**config, **({"quantization_config": quantization} if quantization else {})})
        )
        flags = ["--load-format", "dummy", "--device", a.device, "--dtype", a.dtype, "--max-num-seqs", "64"]
        flags += ["--max-model-len", "1024", "--gpu-memory-utilization", "0.85"]
        try:
            row = part[name] = {}
            with running_stack(model_dir, *flags, timeout_s=600) as (info, _):
                for label, spec, num_requests in runs:
                    run, extra, _ = asyncio.run(
                        bench_server(
                            info["target"], spec, num_requests, name=name, progress=False, timeout_s=300
                        )
                    )
                    row[label] = {
                        "ok": extra["completed"],
                        "output_tokens_per_s": run["output_tokens_per_s"],
                        "tpot_ms_p50": run["tpot_ms"]["p50"],
                    }
        except Exception as e:  # the other formats still run
            part[name] = {"error": f"{type(e).__name__}: {e}"}
        out.write_text(json.dumps(result, indent=2, default=str))
    dense = part.get("dense", {})
    for name in names:
        for label, *_ in runs:
            mine, base = part[name].get(label, {}), dense.get(label, {})
            if mine.get("output_tokens_per_s") and base.get("output_tokens_per_s"):
                mine["speed_vs_dense"] = round(mine["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
