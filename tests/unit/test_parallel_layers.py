"""Each tensor-parallel layer, sharded by hand over 2 and 4 ranks without any communication: the ranks'
partial results, combined as the collective would, equal the unsharded layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from shard_worker.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shard_worker.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from shard_worker.parallel import TensorParallel

WORLD_SIZES = [2, 4]


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ranks(world_size: int) -> list[TensorParallel]:
    return [TensorParallel(rank=r, world_size=world_size) for r in range(world_size)]


def load(param, source, part=None):
    param.weight_loader(param, source, part)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_column_parallel_concatenates_to_the_full_output(ws):
    w, b, x = rand(16, 8, seed=1), rand(16, seed=2), rand(5, 8, seed=3)
    outs = []
    for tp in ranks(ws):
        layer = ColumnParallelLinear(8, 16, tp, bias=True)
        load(layer.weight, w)
        load(layer.bias, b)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b))


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_merged_column_parallel_splits_each_part_on_its_own(ws):
    gate, up, x = rand(12, 8, seed=1), rand(12, 8, seed=2), rand(5, 8, seed=3)
    gates, ups = [], []
    for tp in ranks(ws):
        layer = MergedColumnParallelLinear(8, [12, 12], tp)
        load(layer.weight, gate, 0)
        load(layer.weight, up, 1)
        g, u = layer(x).split(layer.local_sizes, dim=-1)
        gates.append(g)
        ups.append(u)
    torch.testing.assert_close(torch.cat(gates, dim=-1), F.linear(x, gate))
    torch.testing.assert_close(torch.cat(ups, dim=-1), F.linear(x, up))


@pytest.mark.parametrize(
    ("ws", "num_kv_heads"),
    [(2, 4), (4, 4), (2, 2), (4, 2), (2, 1), (4, 1)],  # the last three replicate KV heads
)
def test_qkv_shards_hold_the_kv_heads_their_query_heads_use(ws, num_kv_heads):
    hidden, head_dim, num_heads = 16, 4, 8
    wq, wk, wv = (
        rand(num_heads * head_dim, hidden, seed=1),
        rand(num_kv_heads * head_dim, hidden, seed=2),
        rand(num_kv_heads * head_dim, hidden, seed=3),
    )
    bq, bk, bv = (
        rand(num_heads * head_dim, seed=4),
        rand(num_kv_heads * head_dim, seed=5),
        rand(num_kv_heads * head_dim, seed=6),
    )
    x = rand(3, hidden, seed=7)
    full_q = F.linear(x, wq, bq).view(3, num_heads, head_dim)
    full_k = F.linear(x, wk, bk).view(3, num_kv_heads, head_dim)
    full_v = F.linear(x, wv, bv).view(3, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads  # query heads per KV head

    qs = []
    for tp in ranks(ws):
        layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, tp, bias=True)
        for part, (w, b) in enumerate([(wq, bq), (wk, bk), (wv, bv)]):
            load(layer.weight, w, part)
            load(layer.bias, b, part)
        q, k, v = layer(x).split(layer.local_sizes, dim=-1)
        q = q.view(3, layer.num_local_heads, head_dim)
        k = k.view(3, layer.num_local_kv_heads, head_dim)
        v = v.view(3, layer.num_local_kv_heads, head_dim)
        qs.append(q)
        assert layer.num_local_kv_heads == max(1, num_kv_heads // ws)
        # Local query head i is global head h; it must find its KV head at local index i // local group.
        local_group = layer.num_local_heads // layer.num_local_kv_heads
        for i in range(layer.num_local_heads):
            h = tp.rank * layer.num_local_heads + i
            torch.testing.assert_close(k[:, i // local_group], full_k[:, h // group])
            torch.testing.assert_close(v[:, i // local_group], full_v[:, h // group])
    torch.testing.assert_close(torch.cat(qs, dim=1), full_q)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_row_parallel_partials_sum_to_the_full_output(ws):
    w, b, x = rand(8, 16, seed=1), rand(8, seed=2), rand(5, 16, seed=3)
    partials = []
    for tp in ranks(ws):
        layer = RowParallelLinear(16, 8, tp, bias=True)
        load(layer.weight, w)
        load(layer.bias, b)
        x_shard = x.chunk(ws, dim=-1)[tp.rank]  # what the column-parallel layer before it produces
        partials.append(layer.forward_partial(x_shard))
    # The bias goes in once, after the reduction (as forward does).
    torch.testing.assert_close(sum(partials) + b, F.linear(x, w, b))


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("vocab", [12, 10])  # 10 does not divide by 4: the last shard is padded
def test_vocab_parallel_embedding_partials_sum_to_the_lookup(ws, vocab):
    table, ids = rand(vocab, 6, seed=1), torch.tensor([0, 3, vocab - 1, 5, 9, 2])
    partials = []
    for tp in ranks(ws):
        layer = VocabParallelEmbedding(vocab, 6, tp)
        load(layer.weight, table)
        partials.append(layer.forward_partial(ids))
    torch.testing.assert_close(sum(partials), F.embedding(ids, table))


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("vocab", [12, 10])
def test_lm_head_shards_concatenate_to_the_full_logits(ws, vocab):
    w, h = rand(vocab, 6, seed=1), rand(4, 6, seed=2)
    shards = []
    for tp in ranks(ws):
        layer = ParallelLMHead(vocab, 6, tp)
        load(layer.weight, w)
        shards.append(layer.forward_partial(h))
    # What gather_to_rank0 + the vocab trim in forward do.
    torch.testing.assert_close(torch.cat(shards, dim=-1)[:, :vocab], F.linear(h, w))


def test_loaders_read_safetensors_slices(tmp_path):
    w = rand(16, 8, seed=1)
    save_file({"w": w}, tmp_path / "t.safetensors")
    with safe_open(tmp_path / "t.safetensors", framework="pt") as f:
        col = ColumnParallelLinear(8, 16, TensorParallel(rank=1, world_size=2))
        load(col.weight, f.get_slice("w"))
        row = RowParallelLinear(8, 16, TensorParallel(rank=1, world_size=2))
        load(row.weight, f.get_slice("w"))
    torch.testing.assert_close(col.weight.data, w[8:])
    torch.testing.assert_close(row.weight.data, w[:, 4:])


def test_indivisible_heads_are_a_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads 6 is not divisible by tensor_parallel_size 4"):
        QKVParallelLinear(24, 4, 6, 6, TensorParallel(rank=0, world_size=4))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .* num_key_value_heads 2"):
        QKVParallelLinear(24, 4, 6, 2, TensorParallel(rank=0, world_size=3))
    with pytest.raises(ValueError, match=r"output features 10 is not divisible by tensor_parallel_size 4"):
        MergedColumnParallelLinear(8, [10, 10], TensorParallel(rank=0, world_size=4))


def test_communicating_without_a_group_is_a_clear_error():
    layer = RowParallelLinear(8, 4, TensorParallel(rank=0, world_size=2))
    layer.weight.data.zero_()
    with pytest.raises(RuntimeError, match="no process group"):
        layer(torch.zeros(1, 4))


def test_each_rank_holds_about_a_1_over_n_slice_of_the_weights(tiny_model):
    """Each rank loads only its slices from the checkpoint: its parameters are about 1/N of the model
    (norms are replicated, so a little more)."""
    from shard_worker.model_runner import ModelRunner
    from shard_worker.parallel import TensorParallel

    def weight_bytes(rank, world_size):
        runner = ModelRunner(tiny_model, torch.float32, torch.device("cpu"), TensorParallel(rank, world_size))
        return sum(p.numel() * p.element_size() for p in runner.model.parameters())

    whole = weight_bytes(0, 1)
    for world_size in (2, 4):
        for rank in range(world_size):
            share = weight_bytes(rank, world_size) / whole
            assert 1 / world_size <= share < 1 / world_size + 0.02, (rank, world_size, share)
