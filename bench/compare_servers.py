"""The issue-24 comparison: one OpenAI-compatible load against tpserve and, when given, another server.

    python -m bench.compare_servers --server tpserve=http://127.0.0.1:8000 \\
        [--server vllm=http://127.0.0.1:8001] [--concurrency 1 8 32] [--model NAME]

The workload is `vllm bench serve --dataset-name random --random-input-len 128 --random-output-len 64
--random-range-ratio 0.5 --ignore-eos --temperature 0`'s: random token-id prompts of 64..192 tokens,
64 output tokens each, greedy, EOS ignored, streamed from /v1/completions; at each concurrency,
`--requests-per-slot` x concurrency requests with at most that many in flight. The servers are loaded one
after the other (never at once: they would share the cores). Prints one table, each row's output
throughput divided by the first server's at the same concurrency; --out writes the runs as JSON.
Start tpserve with `tpserve launch --model models/smollm2 --http-port 8000`; vLLM (its own venv, see
issue 24) with `vllm serve models/smollm2 --dtype float32 --max-model-len 2048 --max-num-seqs 128`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import numpy as np

from bench.metrics import RequestResult, details, summarize
from bench.report import format_table

# Ids below this are the special tokens of the small Llamas and SmolLM2 (EOS, chat markers): a random
# prompt of them would read as a conversation's structure, not text.
FIRST_PLAIN_ID = 17


def random_prompts(n: int, input_len: int, range_ratio: float, vocab_size: int, seed: int) -> list[list[int]]:
    """vLLM's random dataset: lengths uniform in input_len * [1 - ratio, 1 + ratio], ids uniform."""
    rng = np.random.default_rng(seed)
    low, high = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
    lengths = rng.integers(max(1, low), high + 1, size=n)
    return [rng.integers(FIRST_PLAIN_ID, vocab_size, size=int(k)).tolist() for k in lengths]


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_tokens=len(prompt), send_time=time.perf_counter())
    completion_tokens = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    completion_tokens = chunk["usage"].get("completion_tokens")
                if any(c.get("text") for c in chunk.get("choices", ())):
                    result.chunks.append((time.perf_counter(), 1))
        result.end_time = time.perf_counter()
    except aiohttp.ClientError as e:
        result.error = f"{type(e).__name__}: {e}"
    # A text chunk can carry several tokens (a detokenizer holds back a partial character): the last
    # chunk takes what the usage counts beyond one per chunk, so throughput counts tokens, not chunks.
    if result.chunks and completion_tokens and completion_tokens > len(result.chunks):
        t, _ = result.chunks[-1]
        result.chunks[-1] = (t, 1 + completion_tokens - len(result.chunks))
    return result


async def run_level(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int):
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def limited(p: list[int]) -> RequestResult:
            async with semaphore:
                return await one_request(session, url, model, p, output_len)

        await limited(prompts[0][:16])  # warm-up: lazy start-up work is not the first request's
        return list(await asyncio.gather(*(limited(p) for p in prompts)))


async def served_model(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


async def main_async(a: argparse.Namespace) -> None:
    servers = [tuple(s.split("=", 1)) for s in a.server]
    runs, reference, counts = [], {}, {}
    for concurrency in a.concurrency:
        n = max(a.requests_per_slot * concurrency, 4)
        prompts = random_prompts(n, a.input_len, a.range_ratio, a.vocab_size, a.seed + concurrency)
        for name, url in servers:
            model = a.model or await served_model(url)
            results = await run_level(url.rstrip("/"), model, prompts, a.output_len, concurrency)
            run_name = f"{name} c{concurrency}"
            runs.append(summarize(run_name, "random", results))
            counts[run_name] = details(results, [a.output_len] * n)
            reference[run_name] = f"{servers[0][0]} c{concurrency}"
            errors = counts[run_name]["errors"]
            print(f"{run_name}: {counts[run_name]['completed']}/{n} ok {errors[:1]}", flush=True)
    print(format_table(runs, counts, reference))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"runs": runs, "details": counts}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", required=True, help="NAME=URL; the first is the reference")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-slot", type=int, default=4, help="requests per concurrency slot")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn below this")
    p.add_argument("--model", default=None, help="the body's model (default: the server's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
