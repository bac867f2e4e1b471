"""CPU weight-only int8 / int4 and W8A8 products against the float32 and bfloat16 oneDNN-prepacked
linear that tpserve runs today, at decode shapes.

    python -m bench.quant_kernels [--threads 1 2] [--rows 1 8 32 64] [--shapes smollm2 llama3-8b]
                                  [--budget 0.1] [--flush-mb 96]
                                  [--skip w8a8dnn i4dyn ...]

One product y = x W^T (x float32 [M, K], y float32 [M, N], the worker's residual stream) per candidate,
timed as the median of calls each made with the weights out of the caches (a --flush-mb buffer is read
before each; a decode step streams every layer's weights from memory, 32 MiB of L3 here holds a few
layers at most). Weights are random; torch.set_flush_denormal(True). Candidates:

    f32      oneDNN-prepacked float32 (mkldnn._reorder_linear_weight + _linear_pointwise), today's default
    bf16     the same in bfloat16, x cast to bf16 and y back (today's --linear-dtype bfloat16)
    i8       aten._weight_int8pack_mm, per-channel int8 weight, float32 x
    i8b      the same with x cast to bf16 (scales bf16)
    i8deq    int8 weight dequantized to bf16 per call, then F.linear in bf16
    w8a8mm   dynamic per-token int8 x (absmax/127), torch._int_mm, rescaled
    w8a8dnn  the same per-token int8 x through onednn.qlinear_pointwise (weight prepacked by
             onednn.qlinear_prepack, x scale 1, per-token scale applied to y)
    w8a8fbg  quantized.linear_dynamic (fbgemm, per-tensor dynamic activation, reduce_range)
    i4       aten._weight_int4pack_mm_for_cpu (tinygemm layout, group g), float32 x
    i4b      the same with x in bf16
    i4dyn    aten._dyn_quant_matmul_4bit (int8 dynamic activation; off ARM a reference C++ loop)
    P8 / P4  shard_worker.model.quant.kernels PackedInt8.matmul / PackedInt4.matmul (what was chosen)
    P8dyn    PackedInt8.matmul_dynamic (W8A8, per-token: fbgemm with rows scaled to absmax 1)

Ratios are speed ratios (time of the baseline / time of the candidate; >1 is faster). The machine is
shared with other engineers' tests: absolute times drift run to run, ratios within one run are what to
read (the candidates take turns call by call). What --threads 2 shows is only meaningful on a quiet
machine. A candidate 10x slower than float32 at some M is not timed at larger M ("-").

The AVX2-only kind of machine can be approximated on an AVX-512 one by capping both dispatchers:
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m bench.quant_kernels (same memory system,
AVX2 code paths; oneDNN then has no native bf16, so bf16 products are emulated).

Figures (2026-12-03, AMD EPYC, AVX-512 with BF16 and VNNI, no AMX; 1 thread; the 2-core machine shared
with other helpers' tests, load average 4-6: cells move 10-30% run to run, a few by 2-5x; read ratios).
us per product, weights out of cache; ratios are speed vs the float32 / bf16 prepacked linear:

    shape (K x N)      M     f32    bf16   int8 P8 (x f32, x bf16)    int4 P4 (x f32, x bf16)    W8A8 (x bf16)
    q/o 576x576        1     277     238     276 (1.01, 0.86)          146 (1.90, 1.63)          253 (0.94)
                       8     315     272     319 (0.99, 0.85)          211 (1.49, 1.29)          460 (0.59)
    k/v 576x192        1     226     211     209 (1.08, 1.01)          139 (1.63, 1.52)          237 (0.89)
    gate/up 576x3072   1     851     523     560 (1.52, 0.93)          226 (3.76, 2.31)          327 (1.60)
                       8     844     574     906 (0.93, 0.63)          516 (1.64, 1.11)          618 (0.93)
                      32    1707    1134    3052 (0.56, 0.37)         1794 (0.95, 0.63)         1123 (1.01)
    down 1536x576      1     567     397     402 (1.41, 0.99)          246 (2.30, 1.61)          293 (1.36)
    lm_head 576x49152  1   30626   16054   18293 (1.67, 0.88)         3351 (9.14, 4.79)         5769 (2.78)
                       8   37757   21668   53108 (0.71, 0.41)        24323 (1.55, 0.89)        20969 (1.03)
                      64  188053  102332  438527 (0.43, 0.23)       207310 (0.91, 0.49)        74176 (1.38)
    8B q/o 4096x4096   1   21774   15155    5847 (3.72, 2.59)         1264 (17.2, 12.0)         1306 (11.6)
                       8   27608   14394   20336 (1.36, 0.71)        16214 (1.70, 0.89)         9416 (1.53)
    8B gate/up x28672  1   35765   17298   10959 (3.26, 1.58)         7016 (5.10, 2.47)         8149 (2.12)
                       8   38583   17607   32557 (1.19, 0.54)        25865 (1.49, 0.68)        13125 (1.34)
                      32  104377   45681  149318 (0.70, 0.31)       106199 (0.98, 0.43)        31932 (1.43)
    8B down 14336x4096 1   19715   10393    4984 (3.96, 2.09)         3638 (5.42, 2.86)         3776 (2.75)
                      64   77875   39241  114048 (0.68, 0.34)        96857 (0.80, 0.41)        24969 (1.57)

Raw kernels (an earlier run with every column, M=1): _weight_int8pack_mm with float32 x 2-8x slower
than with bf16 x, _weight_int4pack_mm_for_cpu 3-40x (so P8/P4 round x to bf16); onednn.qlinear_pointwise
50-180x slower than float32 (it reorders per call); _dyn_quant_matmul_4bit, a reference loop off ARM,
3-22x slower than float32; fbgemm's dynamic linear the fastest int8 product at every M (P8dyn wraps
it per token; at M > 1 its row scaling costs ~40 us, which loses on SmolLM2's small shapes). So:
int4 (tinygemm) wins at batch 1 everywhere (1.4-5.5x int8); int8 weight-only beats bf16 at batch 1 only
on the 8B shapes; at M >= 8 both weight-only kernels lose to bf16 (their cost grows with M), where W8A8
(fbgemm) is the fast int8 path.
AVX2 dispatch (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, same machine; fbgemm keeps its own
dispatch, so its rows are not AVX2's), SmolLM2 shapes at M=1, x f32 (no native bf16 there): int8 P8
1.04-1.53x, int4 P4 1.29-3.32x (lm_head); torch._int_mm gives wrong sums there (oneDNN saturates).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from shard_worker.model.quant.kernels import PackedInt4, PackedInt8, cpu_kind

SHAPES = {
    "smollm2": [  # SmolLM2-135M: hidden 576, 9 heads x 64, 3 kv heads, intermediate 1536, vocab 49152
        ("q/o", 576, 576),
        ("k/v", 576, 192),
        ("gate/up", 576, 3072),
        ("down", 1536, 576),
        ("lm_head", 576, 49152),
    ],
    "llama3-8b": [  # hidden 4096, intermediate 14336 (gate/up merged: 28672)
        ("q/o", 4096, 4096),
        ("gate/up", 4096, 28672),
        ("down", 14336, 4096),
    ],
}
COLUMNS = [
    "f32",
    "bf16",
    "i8",
    "i8b",
    "i8deq",
    "w8a8mm",
    "w8a8dnn",
    "w8a8fbg",
    "i4",
    "i4b",
    "i4dyn",
    "P8",
    "P8dyn",
    "P4",
]


def time_all(fns: dict, x: torch.Tensor, flush: torch.Tensor, budget: float) -> dict[str, float]:
    """Median us of one call per candidate, with the weights out of the caches as in a decode step
    (each layer's weights were evicted by the other layers' since its last product): every timed call
    follows a read of `flush` (larger than the last-level cache). The candidates take turns, one call
    each per round, so that load from other processes falls on all of them alike; at least 3 rounds,
    more until each candidate has had about `budget` seconds."""
    for fn in fns.values():
        fn(x)  # first-call setup
    samples = {name: [] for name in fns}
    rounds = 0
    while rounds < 3 or (rounds < 25 and min(sum(v) for v in samples.values()) < budget):
        for name, fn in fns.items():
            flush.sum()  # read: clean lines, no write-back inside the timed call
            t0 = time.perf_counter()
            fn(x)
            samples[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}


def group_size(k: int) -> int:
    return 128 if k % 128 == 0 else 64  # SmolLM2's K=576 is not a multiple of 128


def quantize_int8(w: torch.Tensor):
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, g: int):
    n, k = w.shape
    groups = w.reshape(n, k // g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(groups / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, zero


def per_token_int8(x: torch.Tensor):
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def candidates(w: torch.Tensor) -> dict:
    """name -> callable(x float32 [M, K]) -> float32 [M, N]; a candidate the build refuses is left out."""
    n, k = w.shape
    g = group_size(k)
    q8, s8 = quantize_int8(w)
    q4, s4, z4 = quantize_int4(w, g)
    out = {}

    f32 = torch.ops.mkldnn._reorder_linear_weight(w)
    out["f32"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, f32, None, "none", [], "")
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        b16 = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16))
        out["bf16"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x.to(torch.bfloat16), b16, None, "none", [], ""
        ).float()
    s8b = s8.to(torch.bfloat16)
    out["i8"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8)
    out["i8b"] = lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q8, s8b).float()
    out["i8deq"] = lambda x: torch.nn.functional.linear(
        x.to(torch.bfloat16), q8.to(torch.bfloat16) * s8b[:, None]
    ).float()
    q8t = q8.t()

    def w8a8mm(x):
        xq, xs = per_token_int8(x)
        return torch._int_mm(xq, q8t).float() * xs * s8

    out["w8a8mm"] = w8a8mm
    try:
        q8dnn = torch.ops.onednn.qlinear_prepack(q8, [1, k])
        one, zero_i, zeros_w = torch.tensor(1.0), torch.tensor(0, dtype=torch.int32), torch.zeros(n).long()

        def w8a8dnn(x):
            xq, xs = per_token_int8(x)
            y = torch.ops.onednn.qlinear_pointwise.tensor(
                xq, one, zero_i, q8dnn, s8, zeros_w, None, 1.0, 0, torch.float32, "none", [], ""
            )
            return y * xs

        out["w8a8dnn"] = w8a8dnn
    except (RuntimeError, AttributeError):
        pass
    try:
        wq = torch.quantize_per_channel(
            q8.float() * s8[:, None], s8.double(), torch.zeros(n).long(), 0, torch.qint8
        )
        fbg = torch.ops.quantized.linear_prepack(wq, None)
        out["w8a8fbg"] = lambda x: torch.ops.quantized.linear_dynamic(x, fbg, True)
    except (RuntimeError, AttributeError):
        pass
    if n % 16 == 0:
        p4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.int(), 1)
        sz = torch.stack([s4, (8 - z4) * s4], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        szb = sz.to(torch.bfloat16)
        out["i4"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4, g, sz)
        out["i4b"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), p4, g, szb
        ).float()
    nib = (q4[:, 0::2] | (q4[:, 1::2] << 4)).contiguous()
    if n * k <= 4096 * 4096:  # a reference loop off ARM: the big shapes would take minutes
        dyn = torch.ops.aten._dyn_quant_pack_4bit_weight(nib, s4, None, g, k, n)
        out["i4dyn"] = lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, dyn, g, k, n)
    p8 = PackedInt8.pack(q8, s8)
    out["P8"] = p8.matmul
    out["P8dyn"] = p8.matmul_dynamic
    p4k = PackedInt4.pack(q4, s4, z4, g)
    out["P4"] = p4k.matmul
    return out


def ratio(table: dict, base: str, name: str) -> str:
    if base not in table or name not in table:
        return "-"
    return f"{table[base] / table[name]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--skip", nargs="*", default=[], choices=COLUMNS, help="candidates not to time")
    parser.add_argument("--budget", type=float, default=0.1, help="seconds of timed calls per cell")
    parser.add_argument("--flush-mb", type=int, default=96, help="read before each timed call")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    flush = torch.empty(args.flush_mb << 18)  # float32: 4 bytes each
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    print(f"CPU: {model}; {cpu_kind()}; torch {torch.__version__}; us per product (median)")
    header = f"{'family':9} {'shape':8} {'K':>5} {'N':>5} {'th':>2} {'M':>3} " + " ".join(
        f"{c:>8}" for c in COLUMNS
    )
    print(header + "   P8/f32 P8/bf16 P4/f32 P4/bf16 P4/P8 dyn/f32 dyn/bf16")
    for family in args.shapes:
        for name, k, n in SHAPES[family]:
            w = torch.randn(n, k) * 0.02
            fns = {c: f for c, f in candidates(w).items() if c not in args.skip}
            del w
            for threads in args.threads:
                torch.set_num_threads(threads)
                slow = set()  # 10x slower than float32 at fewer rows: not timed at more
                for m in args.rows:
                    x = torch.randn(m, k)
                    table = time_all({c: f for c, f in fns.items() if c not in slow}, x, flush, args.budget)
                    slow |= {c for c, t in table.items() if t > 10 * table["f32"]}
                    cells = " ".join(f"{table[c]:8.0f}" if c in table else f"{'-':>8}" for c in COLUMNS)
                    ratios = [
                        ratio(table, b, c)
                        for c, b in (
                            ("P8", "f32"),
                            ("P8", "bf16"),
                            ("P4", "f32"),
                            ("P4", "bf16"),
                            ("P4", "P8"),
                            ("P8dyn", "f32"),
                            ("P8dyn", "bf16"),
                        )
                    ]
                    print(
                        f"{family:9} {name:8} {k:5} {n:5} {threads:2} {m:3} {cells}   "
                        + " ".join(f"{r:>6}" for r in ratios),
                        flush=True,
                    )
            del fns


if __name__ == "__main__":
    main()
