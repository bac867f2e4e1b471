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
with other helpers' tests: cells move 10-30% run to run; read the ratios). Speed vs bf16 (>1 faster):

    shape (N x K)      rows   bf16 us   g32    g16   g16eager  f32
    see the table printed by the run recorded in the branch's report
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
