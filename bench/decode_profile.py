"""Where one decode step's time goes inside the worker: ModelRunner.execute on the real model, by op class.

    python -m bench.decode_profile [--model models/smollm2|x.gguf] [--batch 1 8 32] [--context 160]
                                   [--threads 2] [--steps 30] [--top] [--matmul] [--profile bfloat16:cpu]

Builds a worker's ModelRunner (one rank; --profile's dtype and backend, float32 flex by default), fills a
KV cache, and times decode steps of `batch` greedy sequences at `context` tokens each (the issue's
workload: prompts ~128, outputs 64). Prints the median wall time of execute() and a torch.profiler
breakdown of self CPU time by op class: matmuls (projections, MLP, LM head), attention (the compiled flex
kernel), norms/rotary/activations (the elementwise ops between matmuls), sampling, and everything else
(indexing, step metadata); with the torch ops traced per step and their ms. The cpu backend's ctypes
calls (its attention; the norms, rotary and silu of half types: attention/cpu_ops.py) are not traced.

--matmul times only the step's matmuls (weights streamed from memory), float32 against bfloat16.
--quant: float32, bf16, online int8 and fp8 linear weights (--quantization), execute() at each batch and
teacher-forced NLL per token on fixed 256-token slices of docs/*.md (figures: docs/quantization.md's table;
taken on README.md's text, which has since moved to docs/).
--linear compares the worker's ways of holding a float32 model's linear layers (--linear-dtype dtype
and bfloat16, model/quant/unquantized.py; each prepacked for oneDNN or not),
in one run (bench/decode_compare.py): execute() at each batch, alternating, and the greedy tokens float32
and bfloat16 (both prepacked) give for --prompts slices of docs/*.md (how many of them come out identical,
and where the others first differ).

Figures (issue 24), 2-core AVX-512-BF16 machine shared with other engineers' tests (load average 7 on 2
cores: absolute times are 2-5x what a quiet machine gives; read the shares and the ratios). With
--threads 2 under that load every op stalls at its thread barrier and the shares are noise; --threads 1:

    batch  execute  matmul  attention  elementwise  sampling  other    matmuls fp32 / bf16
        1   122 ms     73%        15%           6%        0%     6%    72 / 40 ms   (1.8x)
        8   223 ms     75%        15%           2%        0%     8%   130 / 47 ms   (2.7x)
       32   462 ms     70%        20%           3%        1%     6%   277 / 90 ms   (3.1x)

Prepacked oneDNN weights (--linear, 2026-12-02, same kind of machine, quieter; execute() ms at one thread,
plain F.linear / prepacked): float32 weights 70.9 / 36.7 at batch 1, 113.4 / 55.5 at 8, 216-243 /
125-139 at 32; bfloat16 58.9 / 31.2, 50.3 / 43.8, 119-133 / 102-104.

So matmuls are three quarters of a decode step, and bf16 weights on this CPU would take 30-50% off it
(what compiling the elementwise ops could save is 2-6%).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.cpu_linear import visible_cpu_linear
from common import gguf_model
from common.sampling import SamplingConfig
from shard_worker.model.config import ModelConfig
from shard_worker.model.quant import cpu_linear
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit, StepInputs

BLOCK_SIZE = 16
GREEDY = SamplingConfig(temperature=0.0)

# Op-name substrings per class, first match wins. Self time is counted, so a composite op (linear)
# counts only what it does itself and its addmm/mm children land in "matmul".
CLASSES = (
    ("matmul", ("mm", "linear", "matmul", "bmm", "addmm", "mkldnn", "onednn")),
    ("attention", ("flex", "compiled", "torchdynamo", "inductor", "cpp_fused", "graph")),
    ("sampling", ("argmax", "sort", "softmax", "topk", "multinomial", "log_softmax")),
    (
        "elementwise",
        ("mul", "add", "rsqrt", "pow", "mean", "silu", "neg", "cat", "cos", "sin", "sub", "div", "exp"),
    ),
)


def op_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def decode_step(batch: int, context: int, first_block: int) -> tuple[StepInputs, int]:
    """A decode step of `batch` sequences at `context` tokens, each with its own blocks."""
    per_seq = -(-context // BLOCK_SIZE)
    tables = [list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq)) for i in range(batch)]
    step = StepInputs(
        seq_ids=range(batch),
        query_lens=[1] * batch,
        context_lens=[context] * batch,
        sample_counts=[1] * batch,
        input_ids=[(7 * i + 11) % 1000 for i in range(batch)],
        block_table=StepInputs.pad_tables(tables),
    )
    return step, first_block + batch * per_seq


def measure(runner: ModelRunner, batch: int, context: int, steps: int, top: bool = False) -> dict[str, float]:
    step, _ = decode_step(batch, context, 1)
    states = [
        runner.sampler.new_state(SequenceInit(i, GREEDY, 0, [1] * (context - 1), context - 1))
        for i in range(batch)
    ]
    for _ in range(3):
        runner.execute(step, states)  # warm-up: compiled graphs for this batch size, allocator
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.execute(step, states)
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof, visible_cpu_linear():
        for _ in range(5):
            runner.execute(step, states)
    by_class: dict[str, float] = defaultdict(float)
    calls = 0
    for evt in prof.key_averages():
        by_class[op_class(evt.key)] += evt.self_cpu_time_total
        calls += evt.count
    total = sum(by_class.values()) or 1.0
    # Torch ops only: the cpu backend's ctypes calls (attention, and on half types the norms, rotary and
    # silu) and Python between ops are not traced; traced ms is what the classes below divide.
    result = {"execute ms": statistics.median(times) * 1e3, "traced ms": total / 5e3, "ops": calls / 5}
    result.update(
        {
            cls: 100.0 * by_class[cls] / total
            for cls in ("matmul", "attention", "elementwise", "sampling", "other")
        }
    )
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return result


def matmul_ms(config, batch: int, dtype: torch.dtype, reps: int = 7) -> float:
    """One decode step's matmuls alone, in dtype: every layer's projections and MLP with its own weights
    (so they stream from memory as in the model, not from cache), then the LM head; the median of reps
    sweeps. For deciding whether bf16 weights would pay on this CPU."""
    hd = config.head_dim
    shapes = [
        (config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * hd),
        (config.num_heads * hd, config.hidden_size),
        (config.hidden_size, 2 * config.intermediate_size),
        (config.intermediate_size, config.hidden_size),
    ] * config.num_layers + [(config.hidden_size, config.vocab_size)]
    weights = [torch.randn(n, k, dtype=dtype) for k, n in shapes]
    inputs = {k: torch.randn(batch, k, dtype=dtype) for k, _ in shapes}
    samples = []
    for i in range(reps + 1):
        t = time.perf_counter()
        for (k, _), w in zip(shapes, weights, strict=True):
            torch.nn.functional.linear(inputs[k], w)
        if i:  # the first sweep warms oneDNN's kernels up
            samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", action="store_true", help="also print the top ops of each batch")
    p.add_argument("--matmul", action="store_true", help="only time the step's matmuls, float32 vs bfloat16")
    p.add_argument(
        "--linear", action="store_true", help="float32 against bfloat16 linear weights: speed, tokens"
    )
    p.add_argument(
        "--quant", action="store_true", help="float32, bf16, online int8 and fp8 linear weights: speed, NLL"
    )
    p.add_argument(
        "--quantized",
        nargs="+",
        metavar="NAME=DIR",
        help="--quant: also these checkpoints of the same model quantized offline (e.g. int4=an AWQ one)",
    )
    p.add_argument(
        "--prompts", type=int, default=16, help="--linear: greedy prompts compared (--quant: slices)"
    )
    p.add_argument("--new-tokens", type=int, default=64, help="--linear: greedy tokens per prompt")
    p.add_argument(
        "--variants",
        nargs="+",
        metavar="DTYPE:BACKEND[:LINEAR][:PACKING]",
        help="execute() ms of these (model dtype, attention backend[, linear weights' dtype][, kernel|onednn|"
        "plain: how linear weights are held, default kernel]), alternating, e.g. float32:flex:bfloat16 (the "
        "float32 default on AVX-512-BF16 before the cpu backend) float32:cpu:bfloat16 bfloat16:cpu "
        "bfloat16:cpu:onednn",
    )
    p.add_argument("--linear-variant", default="native", help="the linear kernel's flag set (cpu_ext.py)")
    p.add_argument(
        "--prefill", type=int, default=0, help="--variants: also time one prompt of this many tokens"
    )
    p.add_argument(
        "--kv-cache-dtype", default=None, help="--variants: the KV cache's dtype (default: --dtype's)"
    )
    p.add_argument(
        "--profile",
        default="float32:flex",
        metavar="DTYPE:BACKEND[:LINEAR]",
        help="the variant the op-class profile runs (e.g. bfloat16:cpu, what --dtype auto serves on "
        "AVX-512-BF16)",
    )
    a = p.parse_args()
    a.model = gguf_model.model_dir(a.model)  # a .gguf file: served from the file (common/gguf_model.py)
    cpu_linear.VARIANT = a.linear_variant
    torch.set_num_threads(a.threads)
    if a.linear or a.variants or a.quant:
        from bench import decode_compare  # it imports this module's measure

        if a.linear:
            decode_compare.compare_linear(a)
        elif a.variants:
            decode_compare.compare_variants(a)
        else:
            decode_compare.compare_quant(a)
        return
    if a.matmul:
        config = ModelConfig.from_pretrained(a.model)
        for b in a.batch:
            f32, bf16 = matmul_ms(config, b, torch.float32), matmul_ms(config, b, torch.bfloat16)
            print(f"batch {b:3d}: matmuls float32 {f32:.1f} ms, bfloat16 {bf16:.1f} ms ({f32 / bf16:.2f}x)")
        return
    dtype, backend, *linear = a.profile.split(":")
    runner = ModelRunner(
        a.model,
        getattr(torch, dtype),
        torch.device("cpu"),
        TensorParallel(),
        attention_backend=backend,
        linear_dtype=getattr(torch, linear[0]) if linear else None,
    )
    per_seq = -(-a.context // BLOCK_SIZE)
    runner.allocate_kv_cache(1 + max(a.batch) * per_seq, BLOCK_SIZE)
    runner.warm_up(BLOCK_SIZE)
    runner.allocate_kv_cache(1 + max(a.batch) * per_seq, BLOCK_SIZE)
    print(f"threads {a.threads}, context {a.context}, {a.profile}: self CPU time by op class (%)")
    for b in a.batch:
        r = measure(runner, b, a.context, a.steps, a.top)
        cells = "  ".join(f"{k} {v:.1f}" for k, v in r.items())
        print(f"batch {b:3d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
