"""bfloat16 linear weights for a float32 model (--linear-dtype, the unquantized linear method in
model/quant/unquantized.py): the products run in bf16 and nothing else changes, checked against
transformers doing the same; and packed weights on CPU (the same method's prepack: our own kernel's
layout, or oneDNN's where the kernel is not there) give the plain weights' products."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from shard_worker.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shard_worker.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard_worker.model.quant import cpu_linear
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from tests.unit.greedy import bf16_products
from tests.unit.test_model_runner import BLOCK_SIZE, BlockPool, Seq, forward_logits, plan

torch.set_flush_denormal(True)


def _prompt_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    runner.allocate_kv_cache(16, BLOCK_SIZE)
    return forward_logits(runner, plan(BlockPool(16), [(Seq(0, ids, len(ids)), len(ids))]))


def test_bf16_linear_weights_compute_what_transformers_computes_with_bf16_products(tiny_model):
    ids = [0] + [(131 + i * 97) % 1000 + 2 for i in range(40)]
    reference = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        exact = reference(torch.tensor([ids])).logits[0]
        bf16_products(reference)
        want = reference(torch.tensor([ids])).logits[0]
    runner = ModelRunner(
        tiny_model, torch.float32, torch.device("cpu"), TensorParallel(), linear_dtype=torch.bfloat16
    )
    got = _prompt_logits(runner, ids)
    assert got.dtype == torch.float32  # activations and logits stay in the model's dtype
    # bf16 products summed in float32 in another order than oneDNN's (our kernel's native bf16 dot
    # products on AVX-512 BF16 CPUs): 1.2e-4 apart at worst there, against the 1e-2 that float32's are off.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=3e-4)
    # ... which is not float32's: the test would see products left in float32.
    assert (got - exact).abs().max() > 1e-2


def test_only_linear_weights_are_cast_and_a_tied_head_gets_its_own_copy(tiny_model, tmp_path):
    config = json.loads((tiny_model / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    runner = ModelRunner(
        tmp_path,
        torch.float32,
        torch.device("cpu"),
        TensorParallel(),
        load_format="dummy",
        linear_dtype=torch.bfloat16,
        prepack_linear=False,  # compared as plain tensors (test_prepack below covers the packed ones)
    )
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    embedding = next(m for m in model.modules() if type(m) is VocabParallelEmbedding)
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    assert embedding.weight.dtype == torch.float32 and head.weight.dtype == torch.bfloat16
    assert torch.equal(head.weight, embedding.weight.to(torch.bfloat16))
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert norms and all(p.dtype == torch.float32 for p in norms)


def _runner(model_dir, linear_dtype, prepack: bool, load_format: str = "auto") -> ModelRunner:
    return ModelRunner(
        model_dir,
        torch.float32,
        torch.device("cpu"),
        TensorParallel(),
        load_format=load_format,
        linear_dtype=linear_dtype,
        prepack_linear=prepack,
    )


def _packing(packing: str, dtype: torch.dtype, monkeypatch) -> None:
    """Skips what this CPU cannot pack; "onednn": as on a machine without our kernel."""
    if packing == "kernel" and not cpu_linear.available(dtype):
        pytest.skip(f"no CPU linear kernel for {dtype} here")
    if packing == "onednn":
        if not torch.backends.mkldnn.is_available():
            pytest.skip("torch built without oneDNN")
        if dtype is torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            pytest.skip("this CPU has no oneDNN bfloat16 products")
        monkeypatch.setattr(cpu_linear, "available", lambda dtype: False)


def _is_packed(module, packing: str) -> bool:
    if packing == "kernel":
        return isinstance(getattr(module, "cpu_packed", None), cpu_linear.PackedLinear)
    return module.weight.is_mkldnn


@pytest.mark.parametrize("packing", ["kernel", "onednn"])
@pytest.mark.parametrize("linear_dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_prepacked_linear_weights_give_the_plain_weights_products(
    tiny_model, linear_dtype, packing, monkeypatch
):
    _packing(packing, linear_dtype or torch.float32, monkeypatch)
    ids = [0] + [(131 + i * 97) % 1000 + 2 for i in range(40)]
    plain, packed = _runner(tiny_model, linear_dtype, False), _runner(tiny_model, linear_dtype, True)
    linears = [m for m in packed.model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    head = next(m for m in packed.model.modules() if isinstance(m, ParallelLMHead))
    assert linears and all(_is_packed(m, packing) for m in linears + [head])
    assert not any(m.weight.is_mkldnn for m in plain.model.modules() if hasattr(m, "weight"))
    want, got = _prompt_logits(plain, ids), _prompt_logits(packed, ids)
    if linear_dtype is torch.bfloat16 and packing == "onednn":  # the same bf16 products and sums
        assert torch.equal(got, want)
    elif linear_dtype is torch.bfloat16:  # another summation order, then rounded to bf16
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    else:  # another summation order than F.linear's
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert packed.describe()["weight_bytes"] == plain.describe()["weight_bytes"]


@pytest.mark.parametrize("packing", ["kernel", "onednn"])
def test_a_packed_tied_head_leaves_the_embedding_plain(tiny_model, tmp_path, packing, monkeypatch):
    _packing(packing, torch.float32, monkeypatch)
    config = json.loads((tiny_model / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = _runner(tmp_path, None, True, load_format="dummy").model
    embedding = next(m for m in model.modules() if type(m) is VocabParallelEmbedding)
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    assert _is_packed(head, packing) and not embedding.weight.is_mkldnn
    held = head.cpu_packed.unpack() if packing == "kernel" else head.weight.to_dense()
    assert torch.equal(held, embedding.weight)
