"""Compile the paged-attention kernels for NVIDIA GPUs with Triton's own toolchain, on a machine without
one: what the interpreter cannot check (tl.dot shapes and dtypes on tensor cores, layouts, shared memory,
ptxas) is checked here, and ptxas' resource report says whether a tile plan spills registers.

Run as `python tests/unit/triton_compile_cases.py [--all]` WITHOUT TRITON_INTERPRET (the interpreter
replaces the kernels). Prints one JSON line per compiled variant and exits 1 if any fails to compile or
spills more than a few words. The default set covers each plan shape once (the test); --all is the
dtype x head_dim x plan matrix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this compiles the real kernels")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from shard_worker.attention.kernels.host import (  # noqa: E402
    NUM_STAGES,
    kernel_constants,
    plan_tiles,
)
from shard_worker.attention.kernels.triton_paged_attention import (  # noqa: E402
    combine_splits_kernel,
    paged_attention_kernel,
)

# A few words of stack (ptxas -v: 4-12 bytes of spill stores at head_dim 80 and fp32 128) cost nothing; a
# plan that really spills (64-row fp32 tiles: 624 to 8264 bytes) fails.
MAX_STACK_BYTES = 32
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
TRITON_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# (dtype, head_dim, queries_per_kv, max_query_len, sliding_window, num_kv_splits, sm[, sinks])
DEFAULT = [
    (torch.bfloat16, 64, 8, 1, 128, 4, 90, True),  # gpt-oss's decode: sinks, a window, split keys
    (torch.float16, 128, 4, 1, 0, 1, 90),
    (torch.bfloat16, 128, 4, 512, 21, 4, 90),
    (torch.float16, 80, 8, 512, 0, 1, 90),
    (torch.float16, 256, 4, 512, 0, 1, 90),
    (torch.float32, 128, 4, 512, 0, 1, 90),
    (torch.float32, 64, 1, 1, 0, 4, 90),
    (torch.float16, 128, 4, 512, 0, 1, 80),
]
ALL = [
    (dtype, head_dim, 4, max_query_len, 0, 1, 90)
    for dtype in TRITON_TYPE
    for head_dim in (64, 80, 128, 256)
    for max_query_len in (1, 512)
]


def signature(kernel, pointer_types: dict[str, str], constants: dict) -> dict[str, str]:
    """Triton types for each argument: pointers as given, scale fp32, the rest int32, constexprs."""
    types = {}
    for name in kernel.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = pointer_types[name]
        else:
            types[name] = "fp32" if name == "qk_scale" else "i32"
    return types


def resources(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    return {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", report)}


def compile_variant(
    dtype, head_dim, queries_per_kv, max_query_len, sliding_window, num_kv_splits, sm, sinks=False
) -> dict:
    plan = plan_tiles(queries_per_kv, max_query_len, head_dim, dtype)
    constants = kernel_constants(
        plan, head_dim, queries_per_kv, 16, dtype, sliding_window, num_kv_splits, sinks
    )
    element = TRITON_TYPE[dtype]
    pointers = {name: f"*{element}" for name in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    pointers |= {name: "*i32" for name in ("block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr")}
    # As host.py passes them: the fp32 workspace when splitting, else out again as an unused placeholder.
    partial = "*fp32" if num_kv_splits > 1 else f"*{element}"
    # The sinks as host.py passes them: float32, or out again as a placeholder.
    sinks_type = "*fp32" if sinks else f"*{element}"
    pointers |= {"partial_out_ptr": partial, "partial_lse_ptr": partial, "sinks_ptr": sinks_type}
    source = ASTSource(
        paged_attention_kernel, signature(paged_attention_kernel, pointers, constants), constants
    )
    target = GPUTarget("cuda", sm, 32)
    kernel = triton.compile(
        source, target=target, options={"num_warps": plan.num_warps, "num_stages": NUM_STAGES}
    )
    result = {
        "dtype": element,
        "head_dim": head_dim,
        "queries_per_kv": queries_per_kv,
        "block_m": plan.block_m,
        "block_n": plan.block_n,
        "num_warps": plan.num_warps,
        "window": sliding_window,
        "splits": num_kv_splits,
        "sinks": sinks,
        "sm": sm,
        "shared_bytes": kernel.metadata.shared,
        **resources(kernel.asm["cubin"]),
    }
    if num_kv_splits > 1:
        combine = {
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": constants["HEAD_DIM_PAD"],
            "NUM_SPLITS": num_kv_splits,
            "HAS_SINKS": sinks,
        }
        combine_pointers = {"out_ptr": f"*{element}", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
        combine_pointers["sinks_ptr"] = sinks_type
        combine_pointers["query_start_loc_ptr"] = "*i32"
        types = signature(combine_splits_kernel, combine_pointers, combine)
        triton.compile(ASTSource(combine_splits_kernel, types, combine), target=target)
    return result


def main(variants) -> int:
    failed = False
    for variant in variants:
        try:
            result = compile_variant(*variant)
            result["ok"] = result["stack"] <= MAX_STACK_BYTES and result["local"] == 0
        except Exception as error:  # a compile error is this variant's result, not the end of the run
            result = {
                "variant": repr(variant),
                "error": f"{type(error).__name__}: {error}"[:2000],
                "ok": False,
            }
        failed |= not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ALL if "--all" in sys.argv else DEFAULT))
