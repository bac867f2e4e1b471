"""DeepSeek-V3's latent attention at decode: the absorbed form (queries folded into the latent's space,
attention over the cached latents as they are: shard_worker/attention/latent.py) against expanding every
cached latent into K and V per head each step. One decode step of a DeepSeek-V3-shaped model with dummy
weights at context 4k, in float32 on this machine's device:

    .venv/bin/python -m bench.mla_decode [--rounds 3] [--batches 1,4] [--context 4096]

The attention is the real model's per rank at --tp 8: hidden 7168, q_lora_rank 1536, kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, 16 of the 128 heads. Few layers (--layers 2),
dense MLPs of 256 (the step is its attention blocks) and a
small vocabulary. Each figure is the best of --rounds, the two forms taking turns within a round, after an
untimed round; the ratio of one run is what to quote.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from shard_worker.attention.latent import LatentAttention
from shard_worker.capacity import synthetic_step
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel

BLOCK_SIZE = 16
SHAPE = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=4096,
    hidden_size=7168,
    intermediate_size=256,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=8,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=256,
    max_position_embeddings=163840,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    hidden_act="silu",
    tie_word_embeddings=False,
)


def load(layers: int, device) -> ModelRunner:
    config = dict(SHAPE, num_hidden_layers=layers, first_k_dense_replace=layers)  # dense layers only
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return ModelRunner(tmp, torch.float32, device, TensorParallel(), load_format="dummy")


def set_form(runner: ModelRunner, absorb: str) -> None:
    for m in runner.model.modules():
        if isinstance(m, LatentAttention):
            m.absorb = absorb


def measure(runner: ModelRunner, batch: int, context: int, rounds: int) -> dict[str, float]:
    """form -> the best decode step's seconds (batch sequences at context tokens)."""
    step, num_blocks = synthetic_step([(1, context)] * batch, BLOCK_SIZE)
    runner.allocate_kv_cache(num_blocks, BLOCK_SIZE)  # once: every step reads the same, touched pages
    best = {"absorbed": float("inf"), "expanded": float("inf")}
    for i in range(rounds + 1):  # the first round warms up, untimed
        for form, absorb in (("absorbed", "always"), ("expanded", "never")):
            set_form(runner, absorb)
            start = time.perf_counter()
            runner.execute(step)
            seconds = time.perf_counter() - start
            if i:
                best[form] = min(best[form], seconds)
    set_form(runner, "auto")
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    # One by default: on a shared 2-core machine, a parallel region waits for whichever of its threads a
    # neighbour's work has descheduled (bench/moe.py): 2 threads made this step 10x slower.
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    device = torch.device(a.device)
    torch.set_num_threads(a.threads)
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    runner = load(a.layers, device)
    print(
        f"decode step ms at context {a.context}, {a.layers} layers, 16 heads of DeepSeek-V3's dims; "
        f"{device}, {torch.get_num_threads()} threads"
    )
    print(f"{'batch':>6} {'absorbed':>10} {'expanded':>10} {'speed-up':>9}")
    for batch in (int(b) for b in a.batches.split(",")):
        best = measure(runner, batch, a.context, a.rounds)
        ratio = best["expanded"] / best["absorbed"]
        print(f"{batch:>6} {best['absorbed'] * 1e3:>10.1f} {best['expanded'] * 1e3:>10.1f} {ratio:>8.1f}x")


if __name__ == "__main__":
    main()
