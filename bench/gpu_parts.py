"""The in-process parts of the GPU check (bench/gpu_check.py runs each in a process of its own, so that a
fault in one, an illegal address on the GPU or a segfault in Triton's interpreter, costs only its figures):

- attention: the Triton backend against the reference backend (in float32 on the same values) in
  float16, bfloat16 and float32, on random mixed steps (decodes, prompts, chunks after cached context,
  short queries; scrambled blocks) and on long decodes that take the split-KV path, with and without a
  sliding window;
- graphs: a model's decode graphs for every bucket up to max_num_seqs, each replayed on a decode step
  padded as much as the bucket allows, against the same step run eagerly (logits and greedy tokens),
  with the step times of both, the capture time and the device memory the graphs took;
- decode_timing: one layer's decode attention at Llama-3-8B's attention shape (32 query heads, 8 KV
  heads, head_dim 128): Triton against the per-sequence reference and flex (each where it runs);
- quant: the quantized products at a Llama-3-8B layer's shapes (bench/gpu_quant.py).

    python -m bench.gpu_parts PART --device cuda --dtype bfloat16 --out part.json [--quick]

--quick: toy shapes on CPU, where the Triton parts need TRITON_INTERPRET=1 (gpu_check sets it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import gpu_quant
from bench.attention import BLOCK_SIZE, make_batch, time_step
from shard_worker.attention import Attention, select_backend
from shard_worker.attention.reference import ReferenceBackend

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Triton (in dtype) against the reference in float32 on the same rounded inputs: the output's rounding,
# and p rounded to dtype before p @ v. bfloat16 under the interpreter truncates rather than rounds.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-4}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_lens(rng: random.Random, quick: bool) -> list[tuple[int, int]]:
    """(query_len, context_len) of a mixed step."""
    top = 80 if quick else 2048
    lens = [(1, rng.randint(1, top)) for _ in range(4 if quick else 24)]  # decodes
    lens += [(c, c) for c in (rng.randint(2, top // 4) for _ in range(1 if quick else 3))]  # prompts
    for _ in range(1 if quick else 3):  # chunks after cached context
        c = rng.randint(top // 4, top // 2)
        lens.append((rng.randint(2, c // 2), c))
    lens += [(rng.randint(2, 5), rng.randint(5, top // 4)) for _ in range(1 if quick else 4)]
    rng.shuffle(lens)
    return lens


def attention_check(a: argparse.Namespace) -> dict:
    device = torch.device(a.device)
    rng = random.Random(0)
    if a.quick:
        shapes, long_decodes = [(4, 2, 16, None), (8, 2, 32, 7)], [(1, 600), (1, 530)]
    else:
        shapes, long_decodes = [(32, 8, 128, None), (8, 1, 64, None), (32, 8, 128, 500)], [(1, 4096)] * 2
    reference = ReferenceBackend(device, torch.float32)
    cases = []
    for name, dtype in DTYPES.items():
        triton = select_backend("triton", device, dtype)
        if device.type != "cuda":
            triton.num_sms = 16  # so that the long decodes split under the interpreter too
        for shape in shapes:
            for kind, lens in (("mixed", _random_lens(rng, a.quick)), ("long decodes", long_decodes)):
                case = _compare(triton, reference, lens, shape, rng, seed=len(cases))
                cases.append({"dtype": name, "step": kind, **case})
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


def _compare(triton, reference, lens, shape, rng: random.Random, seed: int) -> dict:
    """One step through the Triton backend and through the reference in float32 on the same values."""
    heads, kv_heads, head_dim, window = shape
    device, dtype = triton.device, triton.dtype
    num_blocks = sum(-(-c // BLOCK_SIZE) for _, c in lens) + 8
    batch = make_batch(lens, rng, num_blocks, device)
    gen = torch.Generator(device).manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    cache = rand(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    q, k, v = (rand(batch.num_tokens, h, head_dim) for h in (heads, kv_heads, kv_heads))
    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
    with torch.inference_mode():
        ctx = triton.context(batch)
        got = layer(q, k, v, cache.clone(), ctx)
        want = layer(q.float(), k.float(), v.float(), cache.float(), reference.context(batch))
    err = (got.float() - want).abs().max().item()
    return {
        "shape": f"{heads}/{kv_heads}x{head_dim}",
        "window": window,
        "tokens": batch.num_tokens,
        "seqs": len(lens),
        "kv_splits": sorted({splits for splits, _ in ctx.metadata.plans.values()}),
        "max_err": err,
        "tol": TOLERANCE[dtype],
        "ok": err <= TOLERANCE[dtype],
    }


def _median_ms(fn, device, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _graph_runner(a: argparse.Namespace, work: Path):
    """(runner with its cache filled at random, max_num_seqs, max_model_len, longest test context)."""
    from bench.gpu_check import LLAMA3_8B
    from shard_worker.model.builder import build_model
    from shard_worker.model_runner import ModelRunner
    from shard_worker.parallel import TensorParallel

    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    if a.quick:  # the tiny random Llama: buckets 1, 2, 4
        model_dir, load, max_num_seqs, max_model_len, top = build_model("tiny", work), "auto", 4, 256, 60
    else:  # Llama-3-8B shapes, dummy weights: 15 buckets, contexts up to 1,024
        (work / "config.json").write_text(json.dumps(LLAMA3_8B))
        model_dir, load, max_num_seqs, max_model_len, top = work, "dummy", 128, 4096, 1024
    runner = ModelRunner(model_dir, dtype, device, TensorParallel(), load, "triton", cuda_graphs=True)
    runner.allocate_kv_cache(max_num_seqs * -(-top // BLOCK_SIZE) + 8, BLOCK_SIZE)
    gen = torch.Generator(device).manual_seed(0)
    for cache in runner.kv_caches:  # keys and values as many prefills would have left them
        cache.copy_(torch.randn(cache.shape, generator=gen, device=device).to(dtype))
    return runner, max_num_seqs, max_model_len, top


def graph_check(a: argparse.Namespace) -> dict:
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    runner, max_num_seqs, max_model_len, top = _graph_runner(a, Path(tempfile.mkdtemp(prefix="tpserve-")))
    free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    capture_s = runner.capture_cuda_graphs(max_num_seqs, max_model_len)
    graph_mib = (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20 if device.type == "cuda" else 0
    graphs, rng, buckets = runner.graphs, random.Random(1), []
    num_blocks = runner.kv_caches[0].shape[1] - runner.reserved_blocks
    for prev, size in zip((0, *graphs.sizes), graphs.sizes, strict=False):
        n = prev + 1  # the most padding this bucket takes
        batch = make_batch([(1, rng.randint(1, top)) for _ in range(n)], rng, num_blocks, device)

        def eager(b=batch):
            return runner.model(b.input_ids, b.positions, runner.attention.context(b), runner.kv_caches)

        with torch.inference_mode():
            want = runner.model.compute_logits(eager()).float()
            got = runner.model.compute_logits(graphs.replay(batch)).float()
            eager_ms = _median_ms(eager, device, 3 if a.quick else 10)
            replay_ms = _median_ms(lambda b=batch: graphs.replay(b), device, 3 if a.quick else 10)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        # float32 must give the same tokens; half types may flip near-ties of random weights.
        ok = rel < (1e-4 if dtype == torch.float32 else 2e-2) and (agree == 1.0 or dtype != torch.float32)
        buckets.append(
            {"bucket": size, "seqs": n, "logits_rel_err": rel, "tokens_agree": agree,
             "eager_ms": round(eager_ms, 3), "replay_ms": round(replay_ms, 3), "ok": ok}
        )  # fmt: skip
    return {
        "ok": all(b["ok"] for b in buckets),
        "model": "tiny" if a.quick else "Llama-3-8B shapes (dummy weights)",
        "dtype": a.dtype,
        "sizes": list(graphs.sizes),
        "capture_s": round(capture_s, 2),
        "graph_mib": round(graph_mib, 1),
        "buckets": buckets,
    }


def decode_timing(a: argparse.Namespace) -> dict:
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    if a.quick:
        heads, kv_heads, head_dim, cases, rounds = 4, 2, 16, [(4, 64)], 1
    else:
        heads, kv_heads, head_dim, cases, rounds = 32, 8, 128, [(64, 1024), (64, 4096), (1, 8192)], 5
    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5)
    num_blocks = max(n * -(-c // BLOCK_SIZE) for n, c in cases) + 8
    cache = (torch.rand(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device) - 0.5).to(dtype)
    out = {"shape": f"{heads}/{kv_heads}x{head_dim}", "dtype": a.dtype, "cases": []}
    for n, context in cases:
        batch = make_batch([(1, context)] * n, random.Random(0), num_blocks, device)
        row = {"seqs": n, "context": context}
        for name in ("triton", "reference", "flex"):
            try:
                backend = select_backend(name, device, dtype)
            except ValueError as e:  # flex on CUDA, and the like
                row[f"{name}_ms"] = f"skipped: {e}"
                continue
            row[f"{name}_ms"] = round(time_step(backend, layer, batch, cache, rounds) * 1e3, 3)
        out["cases"].append(row)
    return out


PARTS = {"attention": attention_check, "graphs": graph_check, "decode_timing": decode_timing}
PARTS["quant"] = gpu_quant.kernel_check  # its docstring says what it measures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_flush_denormal(True)
    Path(a.out).write_text(json.dumps(PARTS[a.part](a), indent=2, default=str))


if __name__ == "__main__":
    main()
