"""The Triton paged-attention kernels (shard_worker/attention/kernels/), tested on CPU.

- Numerics, under Triton's interpreter, against a float64 reference: each case of triton_kernel_cases.py
  runs in its own process (an out-of-bounds access segfaults the interpreter, and TRITON_INTERPRET must be
  set before the kernels are imported), so a bad access fails one test, not the run.
- Compilation for sm_90 and sm_80 with Triton's bundled ptxas (triton_compile_cases.py), which checks what
  the interpreter does not: tensor-core dot shapes and layouts, shared memory, register spills.
- The host side in this process: tile and split plans, and every launch-time check (each raises before
  anything is launched, so no kernel runs here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

import torch  # noqa: E402

from shard_worker.attention.kernels import (  # noqa: E402
    MAX_HEAD_DIM,
    MAX_KV_SPLITS,
    host,
    kv_split_workspace_numel,
    paged_attention,
    plan_kv_splits,
    plan_tiles,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KERNEL_CASES = [
    "context_lengths",
    "mixed_step",
    "gqa_groups",
    "head_dims",
    "sliding_window",
    "split_kv",
    "padded_bucket",
]


def _run_helper(script: str, args: list[str], env: dict[str, str]) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failures = [line for line in lines if not line["ok"]]
    output = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0 and not failures, (
        f"{script} {args}: exit {proc.returncode}, {failures}\n{output}"
    )
    assert lines, f"{script} {args} reported nothing\n{proc.stderr[-4000:]}"
    return lines


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_reference(case):
    results = _run_helper("triton_kernel_cases.py", [case], {**os.environ, "TRITON_INTERPRET": "1"})
    for result in results:
        print(result)  # the measured errors, with -s


def test_kernels_compile_for_gpus_without_spills(tmp_path):
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").is_file() or not (bin_dir / "cuobjdump").is_file():
        pytest.skip("this triton wheel has no NVIDIA toolchain (ptxas, cuobjdump)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real every time, and leave no cache behind
    for result in _run_helper("triton_compile_cases.py", [], env):
        print(result)


# --- host-side plans -----------------------------------------------------------------------------------


def test_split_kv_only_for_few_long_decodes():
    # Llama-3-8B on one H200 (132 SMs, 8 KV heads, 4 query heads each).
    assert plan_kv_splits(1, 8, 4, 1, 4096, 132) == 16
    assert plan_kv_splits(4, 8, 4, 1, 4096, 132) == 4
    assert plan_kv_splits(64, 8, 4, 1, 4096, 132) == 1  # 512 programs already cover the GPU
    assert plan_kv_splits(1, 8, 4, 1, 300, 132) == 1  # too few keys to share out
    assert plan_kv_splits(1, 8, 4, 512, 4096, 132) == 1  # prefill tiles: the grid is already wide
    assert plan_kv_splits(1, 1, 1, 1, 1 << 20, 10_000) == MAX_KV_SPLITS
    assert plan_kv_splits(0, 8, 4, 1, 4096, 132) == 1
    for num_seqs in range(1, 40):
        splits = plan_kv_splits(num_seqs, 2, 4, 1, 8192, 132)
        assert splits & (splits - 1) == 0  # a power of two: the combine kernel's tile


def test_tile_plans_respect_gpu_minimums():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_dim in (16, 64, 80, 128, 256):
            for queries_per_kv in (1, 2, 3, 4, 7, 8, 16, 32, 64, 128):
                for max_query_len in (1, 2, 5, 512):
                    plan = plan_tiles(queries_per_kv, max_query_len, head_dim, dtype)
                    assert plan.block_m >= 16 and plan.block_m & (plan.block_m - 1) == 0
                    assert plan.block_n >= 16 and plan.block_q >= 1
                    assert plan.block_q * queries_per_kv <= plan.block_m  # a token's heads share a tile


def test_decodes_get_small_tiles_and_prefills_tall_ones():
    assert plan_tiles(4, 1, 128, torch.float16).block_m == 16
    assert plan_tiles(4, 4, 128, torch.float16).block_m == 16  # a 4-token verify still fits
    assert plan_tiles(4, 512, 128, torch.float16).block_m == 64
    assert plan_tiles(32, 1, 128, torch.float16).block_m == 32  # one token's 32 heads


# --- launch-time checks --------------------------------------------------------------------------------


def _step(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, num_blocks=8):
    """Valid arguments for a 2-sequence step (query lengths 3 and 1, contexts 20 and 5)."""
    return {
        "q": torch.zeros(4, num_heads, head_dim, dtype=dtype),
        "k_cache": torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype),
        "v_cache": torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype),
        "block_table": torch.tensor([[3, 1, 0], [5, 0, 0]], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 3, 4], dtype=torch.int32),
        "seq_lens": torch.tensor([20, 5], dtype=torch.int32),
        "scale": 0.125,
    }


@pytest.fixture
def interpreting(monkeypatch):
    """Let CPU tensors past the device check, as TRITON_INTERPRET=1 would (every case below raises before
    a launch, so nothing needs the interpreter itself)."""
    monkeypatch.setattr(host, "INTERPRET", True)


def _replace(**changes):
    args = _step()
    args.update(changes)
    return args


def _noncontiguous_q():
    return torch.zeros(4, 64, 8, dtype=torch.float16).transpose(1, 2)


BAD_ARGUMENTS = {
    "q float64": (_replace(q=torch.zeros(4, 8, 64, dtype=torch.float64)), "q has dtype"),
    "q 2-D": (_replace(q=torch.zeros(4, 512, dtype=torch.float16)), "q must be"),
    "head_dim too large": (_step(head_dim=MAX_HEAD_DIM + 16), "head_dim"),
    "k_cache dtype": (_replace(k_cache=torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)), "k_cache has dtype"),
    "k_cache head_dim": (_replace(k_cache=torch.zeros(8, 16, 2, 32, dtype=torch.float16)), "k_cache must be"),
    "v_cache shape": (_replace(v_cache=torch.zeros(9, 16, 2, 64, dtype=torch.float16)), "v_cache shape"),
    "q last dim strided": (_replace(q=_noncontiguous_q()), "q must be contiguous"),
    "block_size 24": (_step(block_size=24), "block_size"),
    "heads not a multiple": (_step(num_heads=6, num_kv_heads=4), "not a multiple"),
    "too many heads per kv head": (
        _step(num_heads=256, num_kv_heads=1, head_dim=16),
        "query heads per kv head",
    ),
    "seq_lens int64": (_replace(seq_lens=torch.tensor([20, 5])), "seq_lens"),
    "query_start_loc length": (
        _replace(query_start_loc=torch.tensor([0, 4], dtype=torch.int32)),
        "query_start_loc",
    ),
    "block_table int64": (_replace(block_table=torch.zeros(2, 3, dtype=torch.int64)), "block_table"),
    "block_table rows": (_replace(block_table=torch.zeros(3, 3, dtype=torch.int32)), "block_table"),
    "block_table strided": (
        _replace(block_table=torch.zeros(2, 6, dtype=torch.int32)[:, ::2]),
        "block_table rows",
    ),
    "block_table device": (
        _replace(block_table=torch.zeros(2, 3, dtype=torch.int32, device="meta")),
        "block_table",
    ),
    "out dtype": (_replace(out=torch.zeros(4, 8, 64, dtype=torch.float32)), "out must match"),
    "out shape": (_replace(out=torch.zeros(5, 8, 64, dtype=torch.float16)), "out must match"),
    "out strided": (_replace(out=_noncontiguous_q()), "out must be contiguous"),
    "sliding_window negative": (_replace(sliding_window=-1), "sliding_window"),
    "scale a tensor": (_replace(scale=torch.tensor(0.125)), "scale"),
    "max_query_len bool": (_replace(max_query_len=True), "max_query_len"),
    "max_seq_len negative": (_replace(max_seq_len=-5), "max_seq_len"),
    "num_kv_splits 3": (_replace(num_kv_splits=3), "num_kv_splits"),
    "num_kv_splits too many": (_replace(num_kv_splits=2 * MAX_KV_SPLITS), "num_kv_splits"),
    "workspace small": (_replace(num_kv_splits=4, workspace=torch.zeros(10)), "workspace has"),
    "workspace fp16": (
        _replace(num_kv_splits=4, workspace=torch.zeros(10**6, dtype=torch.float16)),
        "workspace must be",
    ),
}


@pytest.mark.parametrize("name", BAD_ARGUMENTS)
def test_launch_checks_name_the_argument(interpreting, name):
    args, message = BAD_ARGUMENTS[name]
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)


def _table(*rows):
    return torch.tensor(rows, dtype=torch.int32)


def _lens(*lens):
    return torch.tensor(lens, dtype=torch.int32)


BAD_INDICES = {
    "block id past num_blocks": (_replace(block_table=_table([3, 8, 0], [5, 0, 0])), "block ids"),
    "negative block id": (_replace(block_table=_table([3, 1, 0], [-1, 0, 0])), "block ids"),
    "context past the table": (_replace(seq_lens=_lens(49, 5), max_seq_len=64), "needs 4 blocks"),
    "query_start_loc from 1": (
        _replace(query_start_loc=torch.tensor([1, 3, 4], dtype=torch.int32)),
        "query_start",
    ),
    "query_start_loc past q": (
        _replace(query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32)),
        "query_start",
    ),
    "max_query_len too low": (_replace(max_query_len=2), "max_query_len=2 is below"),
    "max_seq_len too low": (_replace(max_seq_len=16), "max_seq_len=16"),
}


@pytest.mark.parametrize("name", BAD_INDICES)
def test_index_checks_under_the_debug_flag(interpreting, name):
    args, message = BAD_INDICES[name]
    with pytest.raises(ValueError, match=message):
        paged_attention(**args, check_indices=True)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(host, "INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        paged_attention(**_step())


def test_an_empty_step_launches_nothing(interpreting):
    args = _replace(
        q=torch.zeros(0, 8, 64, dtype=torch.float16),
        query_start_loc=torch.zeros(3, dtype=torch.int32),
    )
    assert paged_attention(**args).shape == (0, 8, 64)


def test_workspace_size_covers_every_split_of_every_row():
    # head_dim 80 is padded to 128 in the partial outputs; one log-sum-exp per (token, head, split).
    assert kv_split_workspace_numel(3, 8, 80, 4) == 3 * 8 * 4 * (128 + 1)
