"""KV capacity at a fixed cache budget: the pool blocks a rank reports and the sequences of a given length
the scheduler can hold at once, for a model's layer groups (common/kv_cache_spec.py) against the same
model with every layer keeping every token (the layout before layer groups).

The model is built from config.json with dummy weights (nothing is read but its shapes and windows), and
the block bytes are the worker's own (ModelRunner.kv_block_bytes, cache tensors as served):

    python -m bench.kv_capacity models/gemma3 --budget-gib 1 --tokens 512 4096 32768

Gemma 3 270M (3 full layers, 15 of 512-token windows, bf16), 1 GiB: 3,640 blocks of every layer against
21,845 of 3 layers; sequences held at once: 113 against 113 at 512 tokens, 14 against 52 at 4,096 (3.7x),
1 against 9 at 32,768.
"""

from __future__ import annotations

import argparse

import torch

from common import kv_cache_spec
from common.kv_cache_spec import blocks_for
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel


def capacity(
    model_dir: str, budget_gib: float, tokens: list[int], block_size: int, dtype: torch.dtype
) -> list:
    """(layout, pool blocks, tokens, sequences of that many tokens held at once) rows."""
    runner = ModelRunner(model_dir, dtype, torch.device("cpu"), TensorParallel(), load_format="dummy")
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--budget-gib", type=float, default=1.0)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    rows = capacity(args.model, args.budget_gib, args.tokens, args.block_size, getattr(torch, args.dtype))
    print(f"{'layout':<18}{'blocks':>10}{'tokens':>10}{'sequences':>11}")
    for name, blocks, n, seqs in rows:
        print(f"{name:<18}{blocks:>10}{n:>10}{seqs:>11}")


if __name__ == "__main__":
    main()
