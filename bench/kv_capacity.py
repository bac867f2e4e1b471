"""KV capacity at a fixed cache budget: the pool blocks a rank reports and the sequences of a given length
the scheduler can hold at once, for a model's layer groups (common/kv_cache_spec.py) against the same
model with every layer keeping every token (the layout before layer groups).

The model is built from config.json with dummy weights (nothing is read but its shapes and windows), and
the block bytes are the worker's own (ModelRunner.kv_block_bytes, cache tensors as served):

    python -m bench.kv_capacity models/gemma3 --budget-gib 1 --tokens 512 4096 32768

Gemma 3 270M (3 full layers, 15 of 512-token windows, bf16), 1 GiB: 3,640 blocks of every layer against
21,845 of 3 layers; sequences held at once: 113 against 113 at 512 tokens, 14 against 52 at 4,096 (3.7x),
1 against 9 at 32,768.

DeepSeek-V3 (--deepseek-v3, no model directory): the real model's shapes (transformers' DeepseekV3Config
defaults: 61 layers, 128 heads of K 192 and V 128, a latent of 512 + 64), the model class built on the
meta device (no memory), its latent pages (DeepseekV3ForCausalLM.kv_cache_shape) in the layout the
scheduler builds from its DescribeResponse, against K and V per head (128 x (192 + 128) a token and layer):

    python -m bench.kv_capacity --deepseek-v3 --budget-gib 64 --tokens 4096 32768

bf16, 64 GiB: 4,997,120 bytes a token against 70,272 (71.1x); 859 blocks against 61,119; sequences held
at once: 3 against 238 at 4,096 tokens, 0 against 29 at 32,768.
A model with linear-attention layers (Qwen3-Next) is sized as its workers size it: a state slot for each
of --max-num-seqs sequences first, the rest in blocks of its attention layers:

    python -m bench.kv_capacity /tmp/q3n --write-qwen3-next --budget-gib 4 --tokens 4096 32768 131072

Qwen3-Next-80B-A3B's shapes, 4 GiB, bf16: 128 slots of 6.14 MiB; 128 against 128 sequences at 4,096
tokens (both capped), 51 against 16 at 32,768 (3.2x), 12 against 4 at 131,072.
"""

from __future__ import annotations

import argparse
import math

import torch

from common import kv_cache_spec
from common.kv_cache_spec import blocks_for
from scheduler.capacity import RankCapacity, settle
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel


def capacity(
    model_dir: str,
    budget_gib: float,
    tokens: list[int],
    block_size: int,
    dtype: torch.dtype,
    max_num_seqs: int = 128,
) -> list:
    """(layout, pool blocks, tokens, sequences of that many tokens held at once) rows."""
    runner = ModelRunner(model_dir, dtype, torch.device("cpu"), TensorParallel(), load_format="dummy")
    if runner.state_slot_bytes():
        return state_capacity(runner, budget_gib, tokens, block_size, max_num_seqs)
    layout = kv_cache_spec.from_describe(runner.model.layer_windows(), block_size)
    print(kv_cache_spec.summary(layout) if layout is not None else "one group of every layer")
    budget = int(budget_gib * 2**30)
    rows = []
    for shared in (False, True):  # every layer a tensor (as before), then the groups sharing tensors
        runner.model.share_kv_tensors = shared
        num_blocks = budget // runner.kv_block_bytes(block_size)
        for n in tokens:
            per_seq = layout.blocks_held(n) if shared and layout is not None else blocks_for(n, block_size)
            rows.append(
                ("layer groups" if shared else "every layer full", num_blocks, n, num_blocks // per_seq)
            )
    return rows


def deepseek_v3_rows(budget_gib: float, tokens: list[int], block_size: int, dtype: torch.dtype) -> list:
    """(layout, pool blocks, tokens, sequences held at once) rows: K and V per head, then MLA's latent."""
    from transformers import DeepseekV3Config

    from shard_worker.model.deepseek_v3 import DeepseekV3ForCausalLM

    hf = DeepseekV3Config()
    config = DeepseekV3ForCausalLM.config_from_hf(hf, "DeepseekV3ForCausalLM")
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, TensorParallel())
    layout = kv_cache_spec.from_describe(model.layer_windows(), block_size, model.layer_latent_dims())
    print(kv_cache_spec.summary(layout))
    # As ModelRunner.kv_block_bytes: every cache tensor's page of one block.
    latent_block = model.num_kv_caches * math.prod(model.kv_cache_shape(1, block_size)) * dtype.itemsize
    per_head = hf.num_attention_heads * (hf.qk_nope_head_dim + hf.qk_rope_head_dim + hf.v_head_dim)
    kv_block = config.num_layers * block_size * per_head * dtype.itemsize
    all_full = kv_cache_spec.group_layers([None] * config.num_layers, block_size)
    budget = int(budget_gib * 2**30)
    rows = []
    for name, lay, block_bytes in (
        ("K/V per head", all_full, kv_block),
        ("MLA latent", layout, latent_block),
    ):
        num_blocks = budget // block_bytes
        rows += [(name, num_blocks, n, kv_cache_spec.sequences_held(num_blocks, lay, n)) for n in tokens]
    print(
        f"bytes a token: {kv_block // block_size:,} against {latent_block // block_size:,} "
        f"({kv_block / latent_block:.1f}x)"
    )
    return rows


def state_capacity(runner, budget_gib: float, tokens: list[int], block_size: int, max_num_seqs: int) -> list:
    """A model with linear-attention layers: the pool and state slots the worker sizes from the budget
    and the scheduler settles (profile_num_blocks, capacity.settle), and the sequences that hold at once
    (a slot each, and blocks of its attention layers), against the same model with a KV cache for every
    layer; both capped at max_num_seqs, as the scheduler caps them."""
    budget = int(budget_gib * 2**30)
    blocks = runner.profile_num_blocks(block_size, 2048, 0.9, budget_gib, max_num_seqs)
    rank = RankCapacity(
        0,
        blocks,
        runner.kv_block_bytes(block_size),
        1 << 30,
        runner.state_slot_bytes(),
        runner.num_state_slots,
    )
    cap = settle([rank], block_size=block_size, max_num_seqs=max_num_seqs)
    model = runner.model
    every_layer = budget // (
        model.config.num_layers * runner.kv_block_bytes(block_size) // model.num_kv_layers
    )
    print(
        f"{model.num_kv_layers} of {model.config.num_layers} layers keep KV; a state slot of "
        f"{cap.state.slot_bytes / 2**20:.2f} MiB per sequence, {cap.state.num_slots} slots "
        f"({cap.state.num_slots * cap.state.slot_bytes / 2**30:.2f} GiB of the budget)"
    )
    rows = []
    for n in tokens:
        full = min(max_num_seqs, every_layer // blocks_for(n, block_size))
        hybrid = kv_cache_spec.sequences_with_state(
            cap.num_blocks, blocks_for(n, block_size), cap.state.num_slots
        )
        rows.append(("every layer full", every_layer, n, full))
        rows.append(("state + attention", cap.num_blocks, n, min(max_num_seqs, hybrid)))
    return rows


def write_qwen3_next(out_dir: str, num_layers: int = 4) -> str:
    """config.json of Qwen3-Next-80B-A3B's shapes (head dims, heads, linear-attention heads, the 3-of-4
    layer pattern) with few layers, few experts and a small vocabulary: the cache is the same per layer."""
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=1024,
        hidden_size=2048,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        partial_rotary_factor=0.25,
        max_position_embeddings=262144,
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    config.save_pretrained(out_dir)
    return out_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="a checkpoint directory (not with --deepseek-v3)")
    p.add_argument("--deepseek-v3", action="store_true", help="DeepSeek-V3's real shapes, no checkpoint")
    p.add_argument("--budget-gib", type=float, default=1.0)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument(
        "--write-qwen3-next", action="store_true", help="first write a Qwen3-Next-shaped config.json to MODEL"
    )
    args = p.parse_args(argv)
    if args.deepseek_v3 == bool(args.model):
        p.error("give a model directory or --deepseek-v3")
    dtype = getattr(torch, args.dtype)
    if args.deepseek_v3:
        rows = deepseek_v3_rows(args.budget_gib, args.tokens, args.block_size, dtype)
    else:
        if args.write_qwen3_next:
            write_qwen3_next(args.model)
        rows = capacity(args.model, args.budget_gib, args.tokens, args.block_size, dtype, args.max_num_seqs)
    print(f"{'layout':<18}{'blocks':>10}{'tokens':>10}{'sequences':>11}")
    for name, blocks, n, seqs in rows:
        print(f"{name:<18}{blocks:>10}{n:>10}{seqs:>11}")


if __name__ == "__main__":
    main()
