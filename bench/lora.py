"""The LoRA workload: random adapters of the model (rank 16 on all seven projections, PEFT's layout, so
vLLM can serve the same directories), requests spread over them, against the base model alone, in one
stack and one run (the ratio is what counts on a shared machine).

    python -m bench.lora --model models/smollm2 [--adapters 8] [--concurrency 8 32] [--profile]

--profile also times one decode step of --concurrency sequences in-process (ModelRunner), base model
against every sequence on an adapter: the step's LoRA share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch
from safetensors.torch import save_file

from common.launcher import running_stack
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model_dir, out_dir, count: int, rank: int, seed: int = 0) -> dict[str, Path]:
    """count random PEFT adapters of the model in out_dir/lora<i>."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        path = Path(out_dir) / f"lora{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for name, (d_in, d_out) in shapes.items():
                part = "self_attn" if name in TARGETS[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
        save_file(tensors, path / "adapter_model.safetensors")
        peft = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
        peft |= {"bias": "none", "base_model_name_or_path": str(model_dir), "task_type": "CAUSAL_LM"}
        (path / "adapter_config.json").write_text(json.dumps(peft))
        out[f"lora{i}"] = path
    return out


async def _one(stub, ids, max_new: int, lora: str) -> int:
    req = pb.GenerateRequest(
        token_ids=ids, max_new_tokens=max_new, ignore_eos=True, sampling=pb.SamplingParams(temperature=0.0)
    )
    req.lora_name = lora
    n = 0
    async for resp in stub.Generate(req, timeout=600):
        n += len(resp.token_ids)
    return n


async def output_tok_s(target: str, adapters: list[str], n: int, concurrency: int, prompt: int, max_new: int):
    """Output tokens per second of n requests (request i on adapters[i % len], "" the base model)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        slots = asyncio.Semaphore(concurrency)

        async def limited(i):
            async with slots:
                ids = [(7 * i + j) % 30000 + 10 for j in range(prompt)]
                return await _one(stub, ids, max_new, adapters[i % len(adapters)])

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(limited(i) for i in range(n))))
        return tokens / (time.perf_counter() - start)


def serve(args, adapters: dict[str, Path]) -> list[dict]:
    flags = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank)]
    flags += ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items()), *args.flags]
    rows = []
    with running_stack(args.model, *flags, timeout_s=600) as (info, _):
        target = info["target"]
        asyncio.run(output_tok_s(target, [""], 4, 4, args.prompt, 8))  # warm-up
        for c in args.concurrency:
            n = args.requests_per_slot * c
            base = asyncio.run(output_tok_s(target, [""], n, c, args.prompt, args.max_new))
            lora = asyncio.run(output_tok_s(target, list(adapters), n, c, args.prompt, args.max_new))
            rows.append(
                {
                    "concurrency": c,
                    "base_tok_s": round(base, 1),
                    "lora_tok_s": round(lora, 1),
                    "ratio": round(lora / base, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def profile(args, adapters: dict[str, Path]) -> list[dict]:
    """One decode step of c sequences at context 256, base against adapters round robin (median of 6)."""
    from shard_worker.capacity import synthetic_step
    from shard_worker.model_runner import ModelRunner
    from shard_worker.parallel import TensorParallel

    modules = tuple(f"{n}={p}" for n, p in adapters.items())
    runner = ModelRunner(
        args.model,
        torch.float32,
        torch.device("cpu"),
        TensorParallel(),
        lora=(modules, args.rank, len(adapters)),
    )
    rows, names = [], list(adapters)
    for c in args.concurrency:
        inputs, blocks = synthetic_step([(1, 256)] * c, 16)
        runner.allocate_kv_cache(blocks + 1, 16)
        times = {}
        for name, seqs in (
            ("base", None),
            ("lora", [SimpleNamespace(lora_name=names[i % len(names)]) for i in range(c)]),
        ):
            inputs.sequences = seqs
            samples = []
            for _ in range(8):
                start = time.perf_counter()
                runner.execute(inputs)
                samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples[2:])
        share = 1 - times["base"] / times["lora"]
        rows.append(
            {
                "concurrency": c,
                "base_step_ms": round(times["base"] * 1e3, 2),
                "lora_step_ms": round(times["lora"] * 1e3, 2),
                "lora_share": round(share, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests = this x concurrency")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--out", default="/tmp/tpserve-lora-bench", help="where the adapters are written")
    p.add_argument("--profile", action="store_true", help="also the in-process step's LoRA share")
    p.add_argument("--no-serve", action="store_true", help="only --profile")
    p.add_argument("flags", nargs="*", help="more `tpserve launch` flags (after --)")
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    adapters = write_adapters(args.model, args.out, args.adapters, args.rank)
    if args.profile:
        profile(args, adapters)
    if not args.no_serve:
        serve(args, adapters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
