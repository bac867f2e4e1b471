"""--kv-cache-dtype in one process on the tiny model: what a block costs (so the same budget holds 2x the
blocks in bf16 and 4x in fp8), caches and swap space in the dtype, flex and the reference agreeing on
what they read back, and the checkpoint's per-layer fp8 scales."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shard_worker.attention import StepBatch
from shard_worker.attention.backend import write_kv
from shard_worker.attention.kv_dtype import kv_cache_dtype
from shard_worker.capacity import synthetic_step
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel

torch.set_flush_denormal(True)
NAMES = ("bfloat16", "fp8_e4m3", "fp8_e5m2")


def runner(model, name="auto", backend="auto") -> ModelRunner:
    kv = kv_cache_dtype(name, torch.float32)
    return ModelRunner(
        model, torch.float32, torch.device("cpu"), TensorParallel(), backend, kv_cache_dtype=kv
    )


def test_a_narrower_cache_holds_more_blocks_in_the_same_budget(tiny_model):
    limits = dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=4, gpu_memory_utilization=0.9)
    full = runner(tiny_model).kv_block_bytes(16)
    for name, ratio in (("bfloat16", 2), ("fp8_e4m3", 4), ("fp8_e5m2", 4)):
        r = runner(tiny_model, name)
        assert r.kv_block_bytes(16) * ratio == full
        assert r.profile_num_blocks(cpu_kv_cache_gib=0.01, **limits) == int(0.01 * 2**30) * ratio // full
        r.allocate_kv_cache(8, 16)
        r.allocate_host_kv_cache(4, 16)
        assert {c.dtype for c in r.kv_caches + r.host_kv_caches} == {r.kv_dtype}


@pytest.mark.parametrize("name", NAMES)
def test_flex_and_the_reference_read_the_same_rounded_cache(tiny_model, name):
    """A prompt, a decode and a short query through both backends: the same hidden states; and a swap out
    and back in keeps the blocks' bytes."""
    hidden = {}
    for backend in ("flex", "cpu", "reference"):
        r = runner(tiny_model, name, backend)
        r.allocate_kv_cache(16, 16)
        r.allocate_host_kv_cache(4, 16)
        step, _ = synthetic_step([(40, 40), (1, 30), (3, 3)], 16)
        step.input_ids[:] = torch.arange(len(step.input_ids)).numpy() % 50 + 2
        batch = StepBatch.build(
            step.input_ids, step.query_lens, step.context_lens, step.block_table, 16, r.device
        )
        with torch.inference_mode():
            hidden[backend] = r.model(
                batch.input_ids, batch.positions, r.attention.context(batch), r.kv_caches
            )
        before = [c.clone() for c in r.kv_caches]
        r.swap_out([0, 3], [1, 2])
        for c in r.kv_caches:
            c[:, [0, 3]] = torch.zeros((), dtype=torch.float32).to(c.dtype)
        r.swap_in([1, 2], [0, 3])
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(before, r.kv_caches, strict=True)
        )
    torch.testing.assert_close(hidden["flex"], hidden["reference"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden["cpu"], hidden["reference"], atol=1e-5, rtol=1e-5)


def test_fp8_scales_come_from_the_checkpoint(tiny_model, tmp_path):
    for f in tiny_model.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path)
    tensors = load_file(tiny_model / "model.safetensors")
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(2.0)
    save_file(tensors, tmp_path / "model.safetensors")
    r = runner(tmp_path, "fp8_e4m3")
    layers = [m.self_attn.attn for m in r.model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in layers] == [(1.0, 1.0), (0.25, 2.0)]
    # Stored as k / k_scale: a key of 100 in layer 1 is 400 in the cache (e4m3 represents 384 and 416).
    r.allocate_kv_cache(4, 16)
    k = torch.full((1, layers[1].num_kv_heads, layers[1].head_dim), 100.0)
    write_kv(r.kv_caches[1], k, k, torch.tensor([0]), layers[1].k_scale, layers[1].v_scale)
    assert float(r.kv_caches[1][0, 0, 0, 0, 0].float()) in (384.0, 416.0)
    assert float(r.kv_caches[1][1, 0, 0, 0, 0].float()) == 48.0
