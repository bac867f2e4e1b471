"""Compile the Triton weight-only GEMM (shard_worker/model/quant/triton_linear.py) for sm_90 with Triton's
bundled ptxas, at each tile plan it can choose: what the interpreter cannot check (tl.dot on tensor cores
in bfloat16/float16, tl.interleave's layouts, shared memory for the pipeline stages, register spills).

Run as `python tests/unit/triton_linear_compile.py` WITHOUT TRITON_INTERPRET. One JSON line per variant;
exits 1 if any fails to compile or spills more than a few words (as triton_compile_cases.py rules).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this compiles the real kernel")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from shard_worker.model.quant.triton_linear import _weight_only_kernel, plan  # noqa: E402
from tests.unit.triton_compile_cases import MAX_STACK_BYTES, resources, signature  # noqa: E402

TRITON_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
DOT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# (bits, zero points, group, x dtype, M): decode, mid and prefill plans at Llama-3-8B's 4096 x 4096.
VARIANTS = [
    (4, True, 128, torch.bfloat16, 1),
    (4, False, 128, torch.float16, 48),
    (8, False, None, torch.bfloat16, 64),
    (4, True, 128, torch.bfloat16, 512),
    (4, True, 32, torch.float32, 1),
    (4, True, 128, torch.bfloat16, 32),
    (4, True, 128, torch.float32, 512),
    (8, False, None, torch.float32, 48),
    (8, False, 16, torch.bfloat16, 1),  # GGUF's Q6_K groups
    (8, False, 32, torch.bfloat16, 512),
    (8, False, None, torch.bfloat16, 1),
    (8, False, None, torch.bfloat16, 512),
]


def compile_variant(bits, has_zero, group, dtype, m, sm=90) -> dict:
    p = plan(m, 4096, 4096, group, 132, dtype == torch.float32)
    constants = {
        "BITS": bits,
        "HAS_ZERO": has_zero,
        "GROUP": group or 0,  # int8 per channel: 0
        "BLOCK_M": p.block_m,
        "BLOCK_N": p.block_n,
        "BLOCK_K": p.block_k,
        "DOT_DTYPE": DOT[dtype],
        "IEEE_DOT": dtype == torch.float32,
    }
    weight = "*u8" if bits == 4 else "*i8"
    out = TRITON_TYPE[dtype] if p.split_k == 1 else "fp32"
    pointers = {"x_ptr": f"*{TRITON_TYPE[dtype]}", "w_ptr": weight, "scale_ptr": "*fp32", "zero_ptr": "*fp32"}
    pointers["out_ptr"] = f"*{out}"
    source = ASTSource(_weight_only_kernel, signature(_weight_only_kernel, pointers, constants), constants)
    options = {"num_warps": p.num_warps, "num_stages": p.num_stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", sm, 32), options=options)
    return {
        "bits": bits,
        "zero": has_zero,
        "group": group,
        "dtype": TRITON_TYPE[dtype],
        "m": m,
        "tiles": [p.block_m, p.block_n, p.block_k],
        "split_k": p.split_k,
        "num_warps": p.num_warps,
        "num_stages": p.num_stages,
        "shared_bytes": kernel.metadata.shared,
        **resources(kernel.asm["cubin"]),
    }


def main() -> int:
    failed = False
    for variant in VARIANTS:
        try:
            result = compile_variant(*variant)
            result["ok"] = result["stack"] <= MAX_STACK_BYTES and result["local"] == 0
        except Exception as error:
            result = {
                "variant": repr(variant),
                "error": f"{type(error).__name__}: {error}"[:2000],
                "ok": False,
            }
        failed |= not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
