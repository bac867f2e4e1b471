"""gpt-oss's released checkpoint format (experts in MXFP4, decoded at load) against transformers on the
same weights: a random gpt-oss checkpoint whose float experts are transformers' decoding of random MXFP4
blocks, and its copy with those blocks and scales in their place (tests/model_families.py)."""

from __future__ import annotations

import pytest
import torch

from shard_worker.model.loader import load_model
from shard_worker.parallel import TensorParallel
from tests.model_families import build_checkpoint, prompts, write_mxfp4_checkpoint
from tests.unit.greedy import hf_greedy, new_runner
from tests.unit.test_model_families import NEW_TOKENS, chunked_greedy

torch.set_flush_denormal(True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    float_dir = build_checkpoint("gpt_oss", root / "float")
    return float_dir, write_mxfp4_checkpoint(float_dir, root / "mxfp4")


def test_mxfp4_checkpoint_decodes_transformers_tokens(checkpoints):
    from transformers import AutoModelForCausalLM

    float_dir, mxfp4_dir = checkpoints
    runner = new_runner(mxfp4_dir, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    # The decoded experts are the float checkpoint's exactly (gate and up deinterleaved, as we hold them).
    ours = runner.model.model.layers[1].mlp.experts
    theirs = reference.model.layers[1].mlp.experts
    want = torch.cat([theirs.gate_up_proj[..., ::2], theirs.gate_up_proj[..., 1::2]], -1).transpose(1, 2)
    assert torch.equal(ours.gate_up_proj, want)
    assert torch.equal(ours.down_proj, theirs.down_proj.transpose(1, 2))
    assert not hasattr(ours, "gate_up_proj_blocks")  # the blocks are not kept
    assert chunked_greedy(runner, prompts(), NEW_TOKENS) == hf_greedy(reference, prompts(), NEW_TOKENS)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mxfp4_shards_as_the_float_checkpoint_and_ranks_sum_to_one(checkpoints, world_size):
    """At --tp 2 and 4 each rank reads its own features' blocks (gate/up rows; the blocks that cover
    down's input features, 16 of a 32-value block at --tp 4): its experts equal what the float
    checkpoint gives that rank, and the ranks' partial MoE outputs (the down bias added by rank 0
    alone) sum to the unsharded layer's."""
    float_dir, mxfp4_dir = checkpoints
    _, whole = load_model(float_dir, torch.float64, CPU, TensorParallel())
    x = torch.randn(9, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    moe = whole.model.layers[0].mlp
    want = moe(x)
    partials = []
    for rank in range(world_size):
        tp = TensorParallel(rank=rank, world_size=world_size)
        _, quantized = load_model(mxfp4_dir, torch.float64, CPU, tp)
        _, plain = load_model(float_dir, torch.float64, CPU, tp)
        for a, b in zip(quantized.model.layers, plain.model.layers, strict=True):
            for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                assert torch.equal(getattr(a.mlp.experts, name), getattr(b.mlp.experts, name)), name
            assert torch.equal(a.self_attn.attn.sinks, b.self_attn.attn.sinks)
        local = quantized.model.layers[0].mlp
        weights, ids = moe_route(local, x)
        partials.append(local.experts(x, ids, weights))
    torch.testing.assert_close(sum(partials), want, rtol=1e-12, atol=1e-12)


def moe_route(moe, x):
    from shard_worker.model.layers.moe import route_top_k_softmax

    return route_top_k_softmax(moe.router(x), moe.top_k)


def test_a_hidden_size_not_in_whole_blocks_is_refused():
    from shard_worker.model.layers.moe import GptOssExperts
    from shard_worker.model.quant.mxfp4 import Mxfp4ExpertMethod

    layer = GptOssExperts(4, 48, 64, TensorParallel(), alpha=1.702, limit=7.0)
    with pytest.raises(ValueError, match="hidden_size 48 is not a multiple of its 32-value blocks"):
        Mxfp4ExpertMethod().create_weights(layer, 4, 48, 64, torch.float32)
