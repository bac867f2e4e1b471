"""Structured outputs' cost: 64 concurrent json_schema requests against the same requests unconstrained.

    python -m bench.structured [--model models/smollm2] [--concurrency 64] [--max-tokens 64] [--rounds 2]

Starts one stack (`tpserve launch`, worker metrics on), then runs, alternating, a round of `concurrency`
chat requests each asking for JSON under a schema (a string, a bounded integer, an enum and an array of at
least 8 objects, so that most answers run to max_tokens like the unconstrained ones), and a round of the
same requests without the schema (ignore_eos, so they run to max_tokens too). It reports output tokens
per second of each, their ratio, and from the worker's own histograms the host time per step spent on
grammar masks on the critical path (waiting for the fill, unpacking, applying), the time llguidance
spent filling them, which overlaps the forward, and rank 0's step time (forward and sampling) in each
kind of round, which a shared machine's load disturbs less than wall time. A benchmark, not a test: the
figures go in the notes.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000},
        "climate": {"enum": ["dry", "wet", "mild"]},
        "districts": {
            "type": "array",
            "minItems": 8,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "area_km2": {"type": "integer"}},
                "required": ["name", "area_km2"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["city", "population", "climate", "districts"],
    "additionalProperties": False,
}


def histogram(port: int, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on a process's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = float(re.search(rf"^{name}_sum(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))
    count = float(re.search(rf"^{name}_count(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))
    return total, count


def one_round(client, n: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    """Wall seconds and output tokens of n concurrent requests."""

    model = client.models.list().data[0].id

    def one(i: int) -> int:
        kw = dict(
            model=model,
            messages=[{"role": "user", "content": f"Describe city number {i} of Spain as JSON."}],
            max_tokens=max_tokens,
            temperature=1.0,
            # top_p 1 (not SmolLM2's default 0.9): top-p must sort the whole vocab for a flat row and not for
            # a masked one, which would credit the grammar with a cheaper draw.
            top_p=1.0,
            seed=i,
        )
        if constrained:
            kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
        else:
            kw["extra_body"] = {"ignore_eos": True}
        return client.chat.completions.create(**kw).usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        tokens = sum(pool.map(one, range(n)))
    return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "models" / "smollm2"))
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()

    import openai

    from common.launcher import running_stack

    flags = ("--http-port", "0", "--metrics-port", "0", "--max-num-seqs", str(a.concurrency))
    with running_stack(a.model, *flags, timeout_s=900) as (info, _):
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{info['http_port']}/v1", api_key="x", max_retries=0, timeout=900
        )
        worker = info["metrics_ports"]["shard-worker rank 0"]
        one_round(client, 4, 8, True)  # warm: the schema compiled, code paths touched
        one_round(client, 4, 8, False)
        results = {"constrained": [], "unconstrained": []}
        tokens_out = {"constrained": [], "unconstrained": []}
        step_ms = {"constrained": [], "unconstrained": []}  # rank 0's forward + sampling, per step
        mask0, fill0 = (histogram(worker, f"tpserve_worker_grammar_{k}_seconds") for k in ("mask", "fill"))
        for _ in range(a.rounds):
            for constrained in (True, False):
                before = histogram(worker, "tpserve_worker_forward_duration_seconds")
                seconds, tokens = one_round(client, a.concurrency, a.max_tokens, constrained)
                after = histogram(worker, "tpserve_worker_forward_duration_seconds")
                kind = "constrained" if constrained else "unconstrained"
                step_ms[kind].append(round((after[0] - before[0]) / (after[1] - before[1]) * 1e3, 2))
                results[kind].append(round(tokens / seconds, 2))
                tokens_out[kind].append(tokens)
        mask1, fill1 = (histogram(worker, f"tpserve_worker_grammar_{k}_seconds") for k in ("mask", "fill"))
    steps = mask1[1] - mask0[1]
    best = {k: max(v) for k, v in results.items()}
    median = {k: statistics.median(v) for k, v in results.items()}
    print(
        json.dumps(
            {
                "concurrency": a.concurrency,
                "max_tokens": a.max_tokens,
                "tokens_per_s": results,
                "output_tokens": tokens_out,
                "worker_step_ms": step_ms,
                "ratio_best": round(best["constrained"] / best["unconstrained"], 3),
                "ratio_median": round(median["constrained"] / median["unconstrained"], 3),
                "grammar_steps": int(steps),
                "mask_ms_per_step": round((mask1[0] - mask0[0]) / steps * 1e3, 3),
                "fill_ms_per_step_overlapped": round((fill1[0] - fill0[0]) / steps * 1e3, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
