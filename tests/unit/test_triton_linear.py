"""The Triton weight-only GEMM for CUDA (shard_worker/model/quant/triton_linear.py), tested on CPU:

- numerics under Triton's interpreter against a float64 product with the dequantized weight, each case of
  triton_linear_cases.py in its own process (as test_triton_kernels.py runs the attention kernel's);
- compilation for sm_90 with Triton's bundled ptxas at each tile plan (no spills);
- here, in process: the tile plans, and which kernel PackedInt4 / PackedInt8 choose per device.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

import torch  # noqa: E402

from shard_worker.model.quant import int8_groups, kernels  # noqa: E402
from shard_worker.model.quant.triton_linear import block_k_limit, plan  # noqa: E402
from tests.unit.test_triton_kernels import _run_helper  # noqa: E402

# Two cases a process: each pays ~3 s importing torch and triton.
CASES = [
    ("int4_shapes", "int4_catches_wrong_zero_and_group"),
    ("int8_shapes", "int8_groups"),
    ("split_k", "packed_weights"),
]


@pytest.mark.parametrize("cases", CASES, ids="+".join)
def test_kernel_matches_the_dequantized_product(cases):
    for result in _run_helper("triton_linear_cases.py", list(cases), {**os.environ, "TRITON_INTERPRET": "1"}):
        print(result)


def test_kernel_compiles_for_hopper_without_spills(tmp_path):
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").is_file() or not (bin_dir / "cuobjdump").is_file():
        pytest.skip("this triton wheel has no NVIDIA toolchain (ptxas, cuobjdump)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    for result in _run_helper("triton_linear_compile.py", [], env):
        print(result)


def test_decode_plans_split_k_to_fill_the_gpu_and_prefill_does_not():
    # Llama-3-8B's o_proj on an H200 (132 SMs): 64 output tiles of 64 channels.
    p = plan(1, 4096, 4096, 128, 132)
    assert (p.block_m, p.block_n) == (16, 64) and p.split_k > 1
    assert p.k_per_split % p.block_k == 0
    assert (p.split_k - 1) * p.k_per_split < 4096 <= p.split_k * p.k_per_split  # none empty, all covered
    assert plan(1, 14336 * 2, 4096, 128, 132).split_k == 1  # gate_up: 448 tiles already
    assert plan(512, 4096, 4096, 128, 132).split_k == 1 and plan(512, 4096, 4096, 128, 132).block_m == 64
    assert plan(33, 4096, 4096, None, 132).block_m == 64
    for m in (1, 7, 16, 17, 64, 65, 4096):
        for group in (32, 64, 128, None):
            p = plan(m, 1000, 4096, group, 132)
            assert p.block_k >= 16 and (group is None or group % p.block_k == 0)
            assert p.block_m >= 16 and p.block_m >= min(m, 64)


def test_a_k_step_stays_in_one_group():
    assert [block_k_limit(g) for g in (16, 32, 96, 128, 4096)] == [16, 32, 32, 128, 4096]
    assert block_k_limit(24) == block_k_limit(8) == 0  # under tl.dot's 16: not served
    assert plan(1, 64, 96, 96, 132).block_k == 32
    assert plan(1, 64, 256, 256, 132).block_k == 64  # the decode step, within the group
    assert plan(1, 64, 16, None, 132).block_k == 16  # a short K is not stepped past by a wide tile


def _int4(n=32, k=256, group=128):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    return q, torch.rand(n, k // group), torch.rand(n, k // group) * 15, group


def test_only_the_listed_devices_take_the_triton_kernels(monkeypatch):
    assert kernels.TRITON_DEVICES == ("cuda",)  # a server: CUDA only; CPU keeps its own kernels
    q, scale, zero, group = _int4()
    cpu_kernels = {"cpu_linear int4", "weight_int4pack_mm_for_cpu", "dequantize"}
    qg, sg = torch.randint(-128, 128, (32, 64), dtype=torch.int8), torch.rand(32, 4)
    assert not int8_groups.PackedInt8Groups.pack(qg, sg, 16).kernel.startswith("triton")
    assert kernels.PackedInt4.pack(q, scale, zero, group).kernel in cpu_kernels
    q8, s8 = torch.randint(-127, 128, (32, 64), dtype=torch.int8), torch.rand(32)
    assert kernels.PackedInt8.pack(q8, s8).kernel == "weight_int8pack_mm"
    # The same weights where the list names their device (as the interpreted cases run them).
    monkeypatch.setattr(kernels, "TRITON_DEVICES", ("cuda", "cpu"))
    packed = kernels.PackedInt4.pack(q, scale, zero, group)
    assert packed.kernel == "triton int4"
    assert packed.qweight.shape == (32, 128) and torch.equal(packed.unpack(), q)  # nibbles along K
    assert torch.equal(packed.scale_t, scale.t()) and torch.equal(packed.zero_t, zero.t())
    assert kernels.PackedInt4.pack(q, scale, None, group).zero_t is None
    assert kernels.PackedInt8.pack(q8, s8).kernel == "triton int8"
    qg, sg = torch.randint(-128, 128, (32, 64), dtype=torch.int8), torch.rand(32, 4)
    assert int8_groups.PackedInt8Groups.pack(qg, sg, 16).kernel == "triton int8 groups"
    # A group the kernel cannot step (power-of-two part 8) is left to the device's other paths.
    q24 = q[:, :240]
    assert kernels.PackedInt4.pack(q24, torch.rand(32, 10), None, 24).kernel != "triton int4"
