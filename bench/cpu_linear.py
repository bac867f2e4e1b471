"""The CPU linear kernel (shard_worker/model/quant/cpu_linear.py) against oneDNN's prepacked product and
F.linear on a model's linear shapes: each layer's weights once, like a step, per number of input rows.

    python -m bench.cpu_linear [--model models/smollm2] [--rows 1 8 32 512] [--threads 1] [--dtype bfloat16]
                               [--variant native|avx2] [--int8]

Prints ms per pass over all of the model's linear weights (its layers' projections and the LM head) and the
weight bytes streamed per second. --int8 adds the same weights quantized to int8 per output row (as
--quantization int8 does): our kernel's int8 product (int8), aten._weight_int8pack_mm (int8pack, what runs
without it) and our kernel on float32 weights (f32), x in --dtype (float32 for f32); and in groups of 32 k
(GGUF's Q8_0): our kernel (q8_0) and int8_groups.PackedInt8Groups (q8groups, what runs without it); and
W8A8 (x quantized per row): our kernel (w8a8) and kernels.PackedInt8.matmul_dynamic (fbgemm). At
one thread the clock is the thread's CPU time (on a shared machine, wall time also counts the others'
turns on the core).
Also holds what bench/decode_profile.py uses to compare packings.

Figures (2026-12-03, AMD EPYC Zen 4, AVX-512 BF16, no AMX, 2 cores shared with other sessions; one
thread; SmolLM2-135M, 211 products, 269 MB in bf16): see the table in shard_worker/model/quant/
cpu_linear.py's docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.sampling import SamplingConfig
from shard_worker.model.quant import cpu_linear, products
from shard_worker.model.quant.int8_groups import PackedInt8Groups
from shard_worker.model.quant.kernels import PackedInt4, PackedInt8
from shard_worker.step import SequenceInit, StepInputs

PACKINGS = ("kernel", "onednn", "plain")


@contextlib.contextmanager
def packing_as(packing: str):
    """Models loaded inside hold their linear weights as `packing` says (onednn: as if this machine had no
    CPU linear kernel; plain: the caller also passes prepack_linear=False)."""
    if packing == "kernel":
        yield
        return
    saved = cpu_linear.available
    cpu_linear.available = lambda dtype: False
    try:
        yield
    finally:
        cpu_linear.available = saved


@contextlib.contextmanager
def visible_cpu_linear():
    """The kernel is a ctypes call the profiler does not see: named for it while profiling."""
    plain = cpu_linear.linear

    def named(*args, **kw):
        with torch.profiler.record_function("cpu_linear"):
            return plain(*args, **kw)

    cpu_linear.linear = named
    try:
        yield
    finally:
        cpu_linear.linear = plain


def prefill_ms(runner, tokens: int, block_size: int = 16, reps: int = 5) -> float:
    """execute() median ms of one sequence's whole prompt of `tokens` tokens in one step."""
    blocks = -(-tokens // block_size)
    runner.allocate_kv_cache(1 + blocks, block_size)
    ids = [(7 * i + 11) % 1000 for i in range(tokens)]
    step = StepInputs(
        seq_ids=[0],
        query_lens=[tokens],
        context_lens=[tokens],
        sample_counts=[1],
        input_ids=ids,
        block_table=StepInputs.pad_tables([list(range(1, 1 + blocks))]),
    )
    times = []
    for i in range(reps + 1):
        states = [runner.sampler.new_state(SequenceInit(0, SamplingConfig(temperature=0.0), 0, ids, tokens))]
        t = time.perf_counter()
        runner.execute(step, states)
        if i:  # the first one warms up
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def model_shapes(model_dir: str, layers: int = 0) -> list[tuple[int, int]]:
    """[N, K] of each linear product of a decoder-only model (q, k, v, o, gate, up, down per layer, then
    the LM head), as the worker's unfused checkpoint names them. layers: only that many layers, no LM head.
    model_dir "llama3-8b": Llama-3-8B's shapes (bench/gpu_check.py's config)."""
    if model_dir == "llama3-8b":
        from bench.gpu_check import LLAMA3_8B as c
    else:
        c = json.loads((Path(model_dir) / "config.json").read_text())
    h, i = c["hidden_size"], c["intermediate_size"]
    layers, head = layers or c["num_hidden_layers"], not layers
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    per_layer = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d), (i, h), (i, h), (h, i)]
    return per_layer * layers + ([(c["vocab_size"], h)] if head else [])


def int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit in groups of `group` k (AWQ's and GPTQ's form, min-max rounding): (q, scale,
    zero) with w ~ (q - zero) * scale, as kernels.PackedInt4 takes them."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return q, scale, zero


def q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0's rule: int8 in groups of 32 k, scale = amax / 127 per group."""
    n, k = w.shape
    groups = w.float().view(n, k // 32, 32)
    scale = groups.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8).view(n, k), scale


def int4_product(x: torch.Tensor, w: PackedInt4) -> torch.Tensor:
    return w.matmul(x)


@contextlib.contextmanager
def tinygemm():
    """PackedInt4s packed inside hold aten's tinygemm layout, as on a CPU without our int4 kernel."""
    saved = cpu_linear.available_int4
    cpu_linear.available_int4 = lambda: False
    try:
        yield
    finally:
        cpu_linear.available_int4 = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--variant",
        default="native",
        help="the kernel's flag set (shard_worker/cpu_ext.py): avx2 measures an AVX2-only CPU's path here "
        "(with ONEDNN_MAX_CPU_ISA=AVX2 in the environment for oneDNN's)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="add int8, W8A8, int4 and fp8 weight-only columns (and float32 weights)",
    )
    p.add_argument("--layers", type=int, default=0, help="only this many layers' products (no LM head)")
    p.add_argument("--group", type=int, default=128, help="--int8: the int4 columns' group (of k)")
    a = p.parse_args()
    cpu_linear.VARIANT = a.variant
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    dtype = getattr(torch, a.dtype)
    gen = torch.Generator().manual_seed(0)
    plain = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for n, k in model_shapes(a.model, a.layers)]
    nbytes = sum(w.numel() * w.element_size() for w in plain)
    held = {"kernel": [cpu_linear.PackedLinear.pack(w) for w in plain], "plain": plain}
    if torch.backends.mkldnn.is_available():
        held["onednn"] = [torch.ops.mkldnn._reorder_linear_weight(w) for w in plain]
    fns = {
        "kernel": cpu_linear.linear,
        "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "plain": F.linear,
    }
    x_dtypes = dict.fromkeys(held, dtype)
    sizes = dict.fromkeys(held, nbytes)
    if a.int8:
        quantized = [products.quantize_int8(w) for w in plain]
        grouped = [q8_0(w) for w in plain]
        int8 = nbytes // dtype.itemsize
        extra = {  # name: (weights, product, x dtype, bytes held)
            "int8": (
                [cpu_linear.PackedLinear.pack(q, scale=s) for q, s in quantized],
                cpu_linear.linear,
                dtype,
                int8,
            ),
            "int8pack": (
                [(q, s.bfloat16()) for q, s in quantized],
                lambda x, w: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w[0], w[1]),
                dtype,
                int8,
            ),
            "f32": (
                [cpu_linear.PackedLinear.pack(w.float()) for w in plain],
                cpu_linear.linear,
                torch.float32,
                4 * int8,
            ),
            "q8_0": (
                [cpu_linear.PackedLinear.pack(q, scale=s) for q, s in grouped],
                cpu_linear.linear,
                dtype,
                int8,
            ),
            "q8groups": (
                [PackedInt8Groups.pack(q, s, 32) for q, s in grouped],
                lambda x, w: w.matmul(x),
                dtype,
                int8,
            ),
            "w8a8": (
                [cpu_linear.PackedLinear.pack_w8a8(q, s) for q, s in quantized],
                cpu_linear.linear,
                dtype,
                int8,
            ),
            "fbgemm": (
                [PackedInt8.pack(q, s) for q, s in quantized],
                lambda x, w: w.matmul_dynamic(x),
                dtype,
                int8,
            ),
            "fp8": (
                [cpu_linear.PackedLinear.pack(q, scale=s) for q, s in map(products.quantize_fp8, plain)],
                cpu_linear.linear,
                dtype,
                int8,
            ),
        }
        groups = [
            a.group if w.shape[1] % a.group == 0 else cpu_linear.int4_group(w.shape[1], w.shape[1])
            for w in plain
        ]
        fours = [int4(w, g) for w, g in zip(plain, groups, strict=True)]
        extra["int4"] = (
            [PackedInt4.pack(*f, g) for f, g in zip(fours, groups, strict=True)],
            int4_product,
            dtype,
            int8 // 2,
        )
        with tinygemm():
            extra["tinygemm"] = (
                [PackedInt4.pack(*f, g) for f, g in zip(fours, groups, strict=True)],
                int4_product,
                dtype,
                int8 // 2,
            )
        assert extra["int4"][0][0].kernel == "cpu_linear int4" and extra["tinygemm"][0][0].tinygemm
        for name, (ws, fn, x_dtype, size) in extra.items():
            held[name], fns[name], x_dtypes[name], sizes[name] = ws, fn, x_dtype, size
    native = bool(cpu_linear.library(a.variant).tp_linear_native(cpu_linear.CODES[dtype]))
    print(
        f"{len(plain)} products, {nbytes / 1e6:.0f} MB of {a.dtype} weights, {a.threads} thread(s); kernel "
        f"{'native' if native else 'in plain loops (no vector path for this dtype here)'}"
    )
    for m in a.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w in plain}}
        xs = {t: {k: x.to(t) for k, x in xs.items()} for t in set(x_dtypes.values())}
        clock = time.thread_time if a.threads == 1 else time.perf_counter
        best = {}
        for _ in range(a.reps):  # packings in turn, so that all see the same background load
            for name, ws in held.items():
                x_of = xs[x_dtypes[name]]
                t = clock()
                for w0, w in zip(plain, ws, strict=True):
                    fns[name](x_of[w0.shape[1]], w)
                best[name] = min(best.get(name, 1e9), clock() - t)
        cells = "  ".join(f"{n} {s * 1e3:6.1f} ms {sizes[n] / s / 1e9:4.1f} GB/s" for n, s in best.items())
        ratio = best.get("onednn", best["plain"]) / best["kernel"]
        print(f"rows {m:4d}: {cells}  kernel {ratio:.2f}x oneDNN", flush=True)
        if a.int8:
            print(
                f"           int8 kernel: {best['kernel'] / best['int8']:.2f}x the {a.dtype} kernel, "
                f"{best['int8pack'] / best['int8']:.2f}x weight_int8pack_mm, "
                f"{best['f32'] / best['int8']:.2f}x float32; q8_0: {best['kernel'] / best['q8_0']:.2f}x the "
                f"{a.dtype} kernel, {best['q8groups'] / best['q8_0']:.2f}x PackedInt8Groups; w8a8: "
                f"{best['kernel'] / best['w8a8']:.2f}x the {a.dtype} kernel, "
                f"{best['fbgemm'] / best['w8a8']:.2f}x fbgemm",
                flush=True,
            )
            print(
                f"           int4 kernel: {best['int8'] / best['int4']:.2f}x the int8 kernel, "
                f"{best['kernel'] / best['int4']:.2f}x the {a.dtype} kernel, "
                f"{best['tinygemm'] / best['int4']:.2f}x tinygemm; "
                f"fp8: {best['kernel'] / best['fp8']:.2f}x the {a.dtype} kernel",
                flush=True,
            )


if __name__ == "__main__":
    main()
