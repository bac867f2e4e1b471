"""The worker's ways of holding a model's linear weights, side by side in one run (bench/decode_profile.py's
--linear, --quant and --variants; see its docstring for the figures): execute() times at each batch,
taken in turn, and how far the outputs move (greedy tokens, teacher-forced NLL per token).

The text both quality checks read is the documentation, docs/*.md in name order (the same text the
README held when the figures were taken, before it moved there).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import numpy as np
import torch

from bench.cpu_linear import PACKINGS, packing_as, prefill_ms
from bench.decode_profile import BLOCK_SIZE, GREEDY, measure
from common import gguf_model
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit, StepInputs

CORPUS = sorted((Path(__file__).resolve().parent.parent / "docs").rglob("*.md"))


def corpus_text() -> str:
    return "\n".join(p.read_text() for p in CORPUS)


def alternating(runners: dict, batch: int, a, per_seq: int) -> dict[str, list[float]]:
    """execute() ms of each runner at this batch, three rounds taken in turn so that all see the same
    background load."""
    ms = {name: [] for name in runners}
    for _ in range(3):
        for name, runner in runners.items():
            runner.allocate_kv_cache(1 + max(a.batch) * per_seq, BLOCK_SIZE)
            ms[name].append(measure(runner, batch, a.context, a.steps // 3 or 1)["execute ms"])
    return ms


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """new_tokens greedy tokens per prompt, the prompts prefilled in one step, then decoded together."""
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)
    runner.allocate_kv_cache(1 + len(prompts) * per_seq, BLOCK_SIZE)
    tables = StepInputs.pad_tables(
        [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(prompts))]
    )
    states = [runner.sampler.new_state(SequenceInit(i, GREEDY, 0, p, len(p))) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    step = StepInputs(range(len(prompts)), lens, lens, [1] * len(prompts), sum(prompts, []), tables)
    outputs: list[list[int]] = [[] for _ in prompts]
    while True:
        tokens = runner.execute(step, states).token_ids
        for out, t in zip(outputs, tokens, strict=True):
            out.append(t)
        if len(outputs[0]) == new_tokens:
            return outputs
        lens = [n + 1 for n in lens]
        step = StepInputs(range(len(prompts)), [1] * len(prompts), lens, [1] * len(prompts), tokens, tables)


def compare_linear(a) -> None:
    from transformers import AutoTokenizer

    variants = {
        "float32": (None, True),
        "bfloat16": (torch.bfloat16, True),
        "float32 unpacked": (None, False),
        "bfloat16 unpacked": (torch.bfloat16, False),
    }
    runners = {
        name: ModelRunner(
            a.model,
            torch.float32,
            torch.device("cpu"),
            TensorParallel(),
            linear_dtype=dtype,
            prepack_linear=prepack,
        )
        for name, (dtype, prepack) in variants.items()
    }
    per_seq = -(-a.context // BLOCK_SIZE)
    for runner in runners.values():
        runner.allocate_kv_cache(1 + max(a.batch) * per_seq, BLOCK_SIZE)
        runner.warm_up(BLOCK_SIZE)
    print(f"threads {a.threads}, context {a.context}: execute() median ms by linear weights")
    header = "  ".join(f"{name:>17}" for name in runners)
    print(f"batch  {header}  fp32 packed/unpacked  bf16 packed/unpacked")
    for b in a.batch:
        ms = alternating(runners, b, a, per_seq)
        med = {name: statistics.median(v) for name, v in ms.items()}
        print(
            f"{b:5d}  "
            + "  ".join(f"{med[name]:14.1f} ms" for name in runners)
            + f"  {med['float32 unpacked'] / med['float32']:20.2f}x"
            + f"  {med['bfloat16 unpacked'] / med['bfloat16']:20.2f}x",
            flush=True,
        )
    for name in ("float32 unpacked", "bfloat16 unpacked"):
        del runners[name]
    text = AutoTokenizer.from_pretrained(a.model)(corpus_text())["input_ids"]
    rng = random.Random(0)
    prompts = []
    for _ in range(a.prompts):
        n = rng.randint(64, 192)
        start = rng.randrange(0, len(text) - n)
        prompts.append(text[start : start + n])
    got = {name: greedy(runner, prompts, a.new_tokens) for name, runner in runners.items()}
    firsts = [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), None)
        for p, q in zip(got["float32"], got["bfloat16"], strict=True)
    ]
    same = sum(f is None for f in firsts)
    print(
        f"greedy, {a.prompts} prompts of 64-192 tokens, {a.new_tokens} new tokens: {same} identical; "
        f"the others first differ at tokens {sorted(f for f in firsts if f is not None)}"
    )
    # Teacher-forced on float32's continuations: does bf16 pick the same next token in the same
    # context, and how likely does each find the text (mean negative log-likelihood per token)?
    agree = total = 0
    nll = {name: 0.0 for name in runners}
    for prompt, cont in zip(prompts, got["float32"], strict=True):
        tokens = prompt + cont
        rows = {
            name: _position_logits(runner, tokens)[len(prompt) - 1 : -1] for name, runner in runners.items()
        }
        agree += int((rows["float32"].argmax(-1) == rows["bfloat16"].argmax(-1)).sum())
        total += len(cont)
        target = torch.tensor(cont)[:, None]
        for name, logits in rows.items():
            nll[name] -= float(torch.log_softmax(logits.double(), -1).gather(1, target).sum())
    print(
        f"teacher-forced over float32's {total} tokens: bf16's argmax agrees at {100 * agree / total:.1f}%; "
        f"NLL per token float32 {nll['float32'] / total:.4f}, bfloat16 {nll['bfloat16'] / total:.4f}"
    )


def compare_quant(a) -> None:
    """--quant: execute() at each batch for float32, bfloat16 and online int8 / fp8 linear weights, and
    the --quantized checkpoints (alternating, in one run), then teacher-forced NLL per token of each on
    fixed slices of docs/*.md."""
    from transformers import AutoTokenizer

    variants = {
        "float32": dict(linear_dtype=None),
        "bfloat16": dict(linear_dtype=torch.bfloat16),
        # The LM head is not quantized; in bf16 (--linear-dtype bfloat16), to compare the kernels alone.
        "int8": dict(quantization="int8", linear_dtype=torch.bfloat16),
        "fp8": dict(quantization="fp8", linear_dtype=torch.bfloat16),
    }
    models = dict.fromkeys(variants, a.model)
    for spec in a.quantized or []:  # NAME=DIR: that checkpoint (the same model quantized offline)
        name, _, path = spec.partition("=")
        variants[name], models[name] = dict(linear_dtype=torch.bfloat16), gguf_model.model_dir(path)
    runners = {
        name: ModelRunner(models[name], torch.float32, torch.device("cpu"), TensorParallel(), **kw)
        for name, kw in variants.items()
    }
    per_seq = -(-a.context // BLOCK_SIZE)
    for runner in runners.values():
        runner.allocate_kv_cache(1 + max(a.batch) * per_seq, BLOCK_SIZE)
        runner.warm_up(BLOCK_SIZE)
    print(f"threads {a.threads}, context {a.context}: execute() median ms (weights MB)")
    print(
        "batch  " + "  ".join(f"{n:>8} ({runners[n].describe()['weight_bytes'] / 1e6:.0f})" for n in runners)
    )
    for b in a.batch:
        ms = alternating(runners, b, a, per_seq)
        print(f"{b:5d}  " + "  ".join(f"{statistics.median(ms[n]):12.1f} ms" for n in runners), flush=True)
    text = AutoTokenizer.from_pretrained(a.model)(corpus_text())["input_ids"]
    nll = {name: 0.0 for name in runners}
    total = 0
    for start in range(0, a.prompts * 256, 256):  # fixed 256-token slices
        tokens = text[start : start + 256]
        target = torch.tensor(tokens[1:])[:, None]
        total += len(tokens) - 1
        for name, runner in runners.items():
            logits = _position_logits(runner, tokens)[:-1]
            nll[name] -= float(torch.log_softmax(logits.double(), -1).gather(1, target).sum())
    base = nll["float32"] / total
    print(
        f"teacher-forced NLL per token over {total} tokens of docs/: "
        + ", ".join(f"{n} {v / total:.4f} ({100 * (v / total / base - 1):+.2f}%)" for n, v in nll.items())
    )


def _position_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Every position's logits for one sequence, prefilled in one step."""
    from shard_worker.attention import StepBatch

    blocks = -(-len(tokens) // BLOCK_SIZE)
    runner.allocate_kv_cache(1 + blocks, BLOCK_SIZE)
    table = StepInputs.pad_tables([list(range(1, 1 + blocks))])
    n = np.array([len(tokens)])
    batch = StepBatch.build(np.array(tokens), n, n, table, BLOCK_SIZE, runner.device)
    with torch.inference_mode():
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.attention.context(batch), runner.kv_caches
        )
        return runner.model.compute_logits(hidden).float()


def compare_variants(a) -> None:
    """execute() median ms of each (dtype, backend[, linear dtype][, packing]) variant at each batch,
    taken in turn; packing: kernel (our CPU linear kernel where it runs: the worker's default), onednn
    (oneDNN's prepacked weights, the worker's choice without the kernel) or plain (F.linear)."""
    kv = getattr(torch, a.kv_cache_dtype) if a.kv_cache_dtype else None
    runners = {}
    for v in a.variants:
        dtype, backend, *rest = v.split(":")
        packing = next((f for f in rest if f in PACKINGS), "kernel")
        linear = [f for f in rest if f and f not in PACKINGS]
        with packing_as(packing):
            runners[v] = ModelRunner(
                a.model,
                getattr(torch, dtype),
                torch.device("cpu"),
                TensorParallel(),
                attention_backend=backend,
                kv_cache_dtype=kv,
                linear_dtype=getattr(torch, linear[0]) if linear else None,
                prepack_linear=packing != "plain",
            )
    per_seq = -(-a.context // BLOCK_SIZE)
    for runner in runners.values():
        runner.allocate_kv_cache(1 + max(a.batch) * per_seq, BLOCK_SIZE)
        runner.warm_up(BLOCK_SIZE)
    first = a.variants[0]
    print(f"threads {a.threads}, context {a.context}: execute() median ms (ratio: {first} / variant)")
    for b in a.batch:
        med = {name: statistics.median(v) for name, v in alternating(runners, b, a, per_seq).items()}
        cells = "  ".join(f"{n} {m:.1f} ms ({med[first] / m:.2f}x)" for n, m in med.items())
        print(f"batch {b:3d}: {cells}", flush=True)
    if a.prefill:
        med = {name: prefill_ms(runner, a.prefill) for name, runner in runners.items()}
        cells = "  ".join(f"{n} {m:.1f} ms ({med[first] / m:.2f}x)" for n, m in med.items())
        print(f"prefill of one {a.prefill}-token prompt: {cells}", flush=True)
