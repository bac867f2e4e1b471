"""CPU products for GGUF's int8-kept types (quant/int8_groups.py) against the bf16 and float32
oneDNN-prepacked linear that the same weights got when dequantized at load (what GGUF's Q8_0 / Q5_0 /
Q6_K layers ran before).

    python -m bench.gguf_kernels [--rows 1 8 32] [--budget 0.05]

Timed as bench/quant_kernels.py times (its time_all: median of calls with the weights out of the
caches, candidates taking turns). Weights random, w = q * scale with q int8 and fp16 scales. Candidates:

    f32 / bf16   the dequantized weight, prepacked for oneDNN (x cast to bf16 and back for bf16)
    g32          PackedInt8Groups at group 32 (Q8_0, Q5_0): two 4-bit tinygemm products
    g16          PackedInt8Groups at group 16 (Q6_K): compiled fused product (1 row) or compiled
                 dequantize to bf16 + matmul (more rows)
    g16eager     group 16 dequantized eagerly to bf16 per product, then F.linear (the plain way)

Figures (2026-12-03, AMD EPYC, AVX-512 with BF16 and VNNI, no AMX; 1 thread; the 2-core machine shared
with other helpers' tests, load average 5: cells move 10-30% run to run; read the ratios). us per
product, (speed vs bf16, >1 faster):

    shape (N x K)     rows   bf16    f32          g32           g16           g16eager
    q/o 576x576          1    346    357 (0.97)    305 (1.14)    510 (0.68)     969 (0.36)
                         8    409    409 (1.00)    429 (0.95)    882 (0.46)    1100 (0.37)
                        32    481    579 (0.83)    913 (0.53)   1041 (0.46)    1363 (0.35)
    gate/up 3072x576     1    743    926 (0.80)    561 (1.32)    712 (1.04)    6830 (0.11)
                         8    784   1007 (0.78)   1134 (0.69)   1700 (0.46)    6742 (0.12)
                        32   1170   1780 (0.66)   3577 (0.33)   2272 (0.51)    5953 (0.20)
    down 576x1536        1    486    603 (0.81)    395 (1.23)    612 (0.79)    2787 (0.17)
                         8    516    621 (0.83)    716 (0.72)   1153 (0.45)    2851 (0.18)
                        32    695    937 (0.74)   1880 (0.37)   1312 (0.53)    2814 (0.25)
    8B q/o 4096x4096     1   3724   6693 (0.56)   2448 (1.52)   2634 (1.41)   92072 (0.04)
                         8   4414   7598 (0.58)   7591 (0.58)  33547 (0.13)   87735 (0.05)
                        32   7861  14885 (0.53)  31096 (0.25)  38424 (0.20)  106614 (0.07)

Earlier runs the same hour put g32 at rows 1 at 1.46-2.67x when its two kernels were called bare: about
50-100 us of each call is Python with the caches cold (this timing evicts them, as a decode step's
weight stream does), which the small shapes feel. The 4096-wide eager (and the compiled many-row)
dequantizations pay page faults for a fresh 32 MB bf16 weight per call.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.quant_kernels import time_all
from shard_worker.model.quant.int8_groups import PackedInt8Groups
from shard_worker.model.quant.kernels import cpu_kind

SHAPES = [  # (name, N, K): SmolLM2-135M's (hidden 576, intermediate 1536) and a Llama-3-8B square
    ("q/o", 576, 576),
    ("gate/up", 3072, 576),
    ("down", 576, 1536),
    ("8B q/o", 4096, 4096),
]


def candidates(n: int, k: int) -> dict:
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    out = {}
    for g in (32, 16):
        scale = (torch.rand(n, k // g) * 0.01 + 1e-3).half().float()
        w = (q.float().view(n, k // g, g) * scale[..., None]).view(n, k)
        if g == 32:
            f32 = torch.ops.mkldnn._reorder_linear_weight(w)
            b16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16())
            out["bf16"] = lambda x, b16=b16: torch.ops.mkldnn._linear_pointwise(
                x.bfloat16(), b16, None, "none", [], ""
            ).float()
            out["f32"] = lambda x, f32=f32: torch.ops.mkldnn._linear_pointwise(x, f32, None, "none", [], "")
        out[f"g{g}"] = PackedInt8Groups.pack(q, scale, g).matmul
    scale_bf16 = scale.bfloat16()[..., None]
    out["g16eager"] = lambda x: F.linear(
        x.bfloat16(), (q.view(n, k // 16, 16).bfloat16() * scale_bf16).view(n, k)
    ).float()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_flush_denormal(True)
    torch.set_num_threads(a.threads)
    flush = torch.ones(96 * 2**18)  # 96 MiB read before each call: weights out of the caches
    print(f"{cpu_kind()}, {a.threads} thread(s); us per product; (x) speed vs bf16")
    for name, n, k in SHAPES:
        fns = candidates(n, k)
        for m in a.rows:
            t = time_all(fns, torch.randn(m, k), flush, a.budget)
            cells = "  ".join(f"{c} {t[c]:.0f} ({t['bf16'] / t[c]:.2f})" for c in fns if c != "bf16")
            print(f"{name:8s} {n}x{k} rows {m:2d}: bf16 {t['bf16']:.0f}  {cells}", flush=True)


if __name__ == "__main__":
    main()
