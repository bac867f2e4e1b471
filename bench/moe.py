"""The mixture-of-experts layer against a dense MLP of the same active parameters, and against itself with
2x and 4x the experts at the same top-k: one decode step of a small Mixtral-shaped model (4 layers,
hidden 512, 8 heads / 2 KV heads, experts 1792 wide, top-2 of 8) at batch 1, 32 and 128, each sequence
at context 128, with dummy weights, in float32 on this machine's device; and one layer's MLP block alone
(router and experts, or the dense MLP) on the same batch.

    .venv/bin/python -m bench.moe [--rounds 5] [--batches 1,32,128]

The dense model is Mistral-shaped with intermediate 2 x 1792, so that a token passes through as many
parameters as in the MoE (top-2 experts of 1792). Each figure is the best of --rounds, the models taking
turns within a round, after an untimed round (which compiles the attention kernels). Ratios from one run
are what to quote.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from shard_worker.capacity import synthetic_step
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel

BLOCK_SIZE = 16
CONTEXT = 128
SHAPE = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    hidden_act="silu",
    tie_word_embeddings=False,
)
EXPERT_SIZE = 1792
TOP_K = 2


def models() -> dict[str, dict]:
    moe = lambda experts: dict(  # noqa: E731
        SHAPE,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=EXPERT_SIZE,
        num_local_experts=experts,
        num_experts_per_tok=TOP_K,
    )
    dense = dict(
        SHAPE,
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        intermediate_size=TOP_K * EXPERT_SIZE,
    )
    return {"dense": dense, "moe-8": moe(8), "moe-16": moe(16), "moe-32": moe(32)}


def timed(fn, device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def load(config: dict, device) -> ModelRunner:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return ModelRunner(tmp, torch.float32, device, TensorParallel(), load_format="dummy")


def measure(
    runners: dict[str, ModelRunner], batch: int, rounds: int, device
) -> dict[str, tuple[float, float]]:
    """name -> (best decode step seconds, best MLP block seconds) at this batch. The models take turns
    within each round, so a neighbour's burst of work slows them alike rather than one of them."""
    step, num_blocks = synthetic_step([(1, CONTEXT)] * batch, BLOCK_SIZE)
    # Distinct tokens: with synthetic_step's token 0 everywhere every sequence would route to the same
    # two experts, the MoE's best case rather than its usual one.
    step.input_ids[:] = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], len(step.input_ids))
    cases = {}
    for name, runner in runners.items():
        runner.allocate_kv_cache(num_blocks, BLOCK_SIZE)
        layer = runner.model.model.layers[0]
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        x = torch.randn(batch, runner.config.hidden_size, device=device)
        cases[name] = (lambda r=runner: r.execute(step), lambda b=block, x=x: b(x))
    best = {name: [float("inf"), float("inf")] for name in runners}
    with torch.inference_mode():
        for i in range(rounds + 1):  # the first round compiles and warms up, untimed
            for name, fns in cases.items():
                for k, fn in enumerate(fns):
                    seconds = timed(fn, device)
                    if i:
                        best[name][k] = min(best[name][k], seconds)
    return {name: (s, b) for name, (s, b) in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--device", default="cpu")
    # One by default: on a shared 2-core machine, a parallel region waits for whichever of its threads a
    # neighbour's work has descheduled, and a 1x512 scatter then takes milliseconds.
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    device = torch.device(a.device)
    torch.set_num_threads(a.threads)
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    batches = [int(b) for b in a.batches.split(",")]
    runners = {name: load(config, device) for name, config in models().items()}
    by_batch = {b: measure(runners, b, a.rounds, device) for b in batches}
    results = {name: {b: by_batch[b][name] for b in batches} for name in runners}
    print(
        f"decode step ms [ratio to dense / to moe-8], one layer's MLP block ms; {device}, {a.threads} thread"
    )
    print(f"{'model':>8} " + " ".join(f"{'batch ' + str(b):>30}" for b in batches))
    for name, by_batch in results.items():
        cells = []
        for b in batches:
            step, block = by_batch[b]
            dense_step, dense_block = results["dense"][b]
            base_step, base_block = results["moe-8"][b]
            ratio = "" if name == "dense" else f" [{step / dense_step:.2f}/{step / base_step:.2f}]"
            cells.append(f"{step * 1e3:7.2f}{ratio:>12} {block * 1e3:6.2f}")
        print(f"{name:>8} " + " ".join(f"{c:>30}" for c in cells))


if __name__ == "__main__":
    main()
