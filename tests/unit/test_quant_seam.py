"""The linear-method seam: quantized parameters sharded by the layers' one weight loader (row-parallel
group scales and zero points split with the input features; per-tensor scales kept per merged part), the
ranks' partial products summing to the unsharded product as tests/unit/test_parallel_layers.py checks
for plain weights; which layers a compressed-tensors config quantizes; and the pins."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors import pack_to_int32

from shard_worker import config as worker_config
from shard_worker.model import quant
from shard_worker.model.layers.linear import QKVParallelLinear, RowParallelLinear
from shard_worker.model.quant import cpu_linear
from shard_worker.model.quant.compressed_tensors import CompressedTensorsConfig, Fp8Method, PackedIntMethod
from shard_worker.model.quant.unquantized import UnquantizedLinearMethod
from shard_worker.parallel import TensorParallel

N, K, GROUP = 48, 512, 128


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int4_on_disk() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A [N, K] 4-bit asymmetric group-128 weight in compressed-tensors' pack-quantized form (packed by
    compressed-tensors itself), and the weight it stands for."""
    q = torch.randint(-8, 8, (N, K), generator=gen(1), dtype=torch.int8)
    zero = torch.randint(-8, 8, (N, K // GROUP), generator=gen(2), dtype=torch.int8)
    scale = torch.rand(N, K // GROUP, generator=gen(3)) * 0.1 + 0.01
    w = (q.float() - zero.float().repeat_interleave(GROUP, 1)) * scale.repeat_interleave(GROUP, 1)
    tensors = {
        "weight_packed": pack_to_int32(q, 4),
        "weight_scale": scale,
        "weight_zero_point": pack_to_int32(zero, 4, packed_dim=0),
        "weight_shape": torch.tensor([N, K]),
    }
    return tensors, w


def row_layer(tp: TensorParallel, tensors: dict[str, torch.Tensor]) -> RowParallelLinear:
    layer = RowParallelLinear(K, N, tp)
    layer.set_method(PackedIntMethod(4, GROUP, symmetric=False))
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor, None)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("ws", [2, 4])
def test_row_parallel_int4_shards_with_group_scales_sum_to_the_whole(ws):
    tensors, w = int4_on_disk()
    # float64: the products are the dequantized shards' (the CPU kernels' own precision, bfloat16
    # activations, is tests/unit/test_quant_kernels.py's).
    x = torch.randn(5, K, generator=gen(4), dtype=torch.float64)
    whole = row_layer(TensorParallel(), tensors).forward_partial(x)
    torch.testing.assert_close(whole, F.linear(x, w.double()), rtol=1e-9, atol=1e-9)
    xs = x.chunk(ws, dim=-1)  # a row-parallel layer's input arrives split (a column-parallel output)
    parts = [
        row_layer(TensorParallel(rank=r, world_size=ws), tensors).forward_partial(xs[r]) for r in range(ws)
    ]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-9, atol=1e-9)


def test_a_group_split_across_ranks_is_refused_naming_it():
    tensors, _ = int4_on_disk()
    with pytest.raises(ValueError, match="64 input features per rank are not whole groups of 128"):
        row_layer(TensorParallel(rank=1, world_size=8), tensors)  # 64 input features a rank


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_qkv_fp8_with_a_scale_per_projection_concatenates_to_the_whole(ws, fused):
    hidden, head_dim, heads, kv_heads = 32, 8, 4, 2
    sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    weights = [torch.randn(n, hidden, generator=gen(i)).to(torch.float8_e4m3fn) for i, n in enumerate(sizes)]
    scales = [torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0])]
    x = torch.randn(3, hidden, generator=gen(9))
    outs = []
    for rank in range(ws):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, TensorParallel(rank=rank, world_size=ws))
        layer.set_method(Fp8Method(per_tensor=True, dynamic_act=False, per_token=False))
        if fused:  # one scale for all three when the checkpoint fuses them
            layer.weight.weight_loader(layer.weight, torch.cat(weights), None)
            layer.weight_scale.weight_loader(layer.weight_scale, scales[0], None)
        else:
            for i, (wq, s) in enumerate(zip(weights, scales, strict=True)):
                layer.weight.weight_loader(layer.weight, wq, i)
                layer.weight_scale.weight_loader(layer.weight_scale, s, i)
        layer.quant_method.process_weights_after_loading(layer)
        outs.append(layer(x).split(layer.local_sizes, dim=-1))
    # x as the product takes it: rounded to bf16 where our CPU kernel multiplies e4m3 in bf16 pairs.
    if getattr(layer, "cpu_packed", None) is not None and cpu_linear.int8_rounds_x():
        x = x.bfloat16().float()
    for i in range(3):
        want = F.linear(x, weights[i].float() * (scales[0] if fused else scales[i]))
        torch.testing.assert_close(torch.cat([o[i] for o in outs], dim=-1), want)


def ct_config(ignore, targets=("Linear",)) -> CompressedTensorsConfig:
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    group = {"targets": list(targets), "weights": weights, "format": "int-quantized"}
    qc = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "ignore": ignore}
    return quant.select_quant_config(qc, None, UnquantizedLinearMethod())


def test_ignored_and_untargeted_layers_stay_unquantized():
    config = ct_config(["lm_head", "re:.*mlp\\.down_proj$"])
    q = "model.layers.0.self_attn.q_proj"
    assert config.linear_method(None, "lm_head", ["lm_head"]) is config.unquantized
    assert config.linear_method(None, "x", ["model.layers.3.mlp.down_proj"]) is config.unquantized
    assert config.linear_method(None, "x", [q]) is not config.unquantized
    only_attention = ct_config([], targets=["re:.*self_attn.*"])
    assert (
        only_attention.linear_method(None, "x", ["model.layers.0.mlp.up_proj"]) is only_attention.unquantized
    )
    # A merged layer whose parts the checkpoint treats differently cannot be one layer here.
    with pytest.raises(ValueError, match="quantized differently"):
        ct_config(["re:.*k_proj$"]).linear_method(None, "qkv_proj", [q, q.replace("q_", "k_")])


def test_the_worker_flag_offers_exactly_the_registered_online_formats():
    assert worker_config.QUANTIZATION_CHOICES == quant.QUANTIZATION_CHOICES


def test_installed_torch_is_the_pinned_one():
    # A package added for a format (compressed-tensors depends on torch) must not bring another torch.
    assert importlib.metadata.version("torch").split("+")[0] == "2.13.0"
