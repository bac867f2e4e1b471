"""Embedding throughput: tpserve's /v1/embeddings against sentence-transformers in-process, on the same CPU
with the same threads, over one corpus of sentences of mixed length (short, medium, long: 4-12, 20-40 and
80-120 words of a fixed vocabulary, seeded).

sentence-transformers encodes the corpus in batches of 1, 8 and 64 (model.encode(batch_size=b); it runs
one batch at a time, so concurrency does not apply to it). tpserve gets the corpus as requests of 1, 8
and 64 inputs, at concurrency 1 to 32 (requests in flight), through its HTTP server: the router tokenizes,
the scheduler batches the inputs of every request in flight under --max-num-batched-tokens, the worker
runs them. The two never run at once (sentence-transformers first, then the stack).

Both run in each --dtypes entry: float32 (the model's own dtype, sentence-transformers' default) and
bfloat16 (tpserve's --dtype auto on a CPU that multiplies it natively; sentence-transformers loaded with
model_kwargs torch_dtype=bfloat16). One table: sentences per second of each, tpserve's over
sentence-transformers' in the same dtype, and the product's default against the other's (tpserve --dtype
auto against sentence-transformers as loaded by default); with the CPU (model name, AVX-512 BF16, AMX) and
the threads. A benchmark, not a test: ratios in one run.

    .venv/bin/pip install sentence-transformers==6.3.0   # pyproject's embedding-bench extra
    .venv/bin/python -m bench.embeddings --model models/minilm --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WORDS = [
    "the", "a", "of", "and", "to", "in", "is", "it", "on", "for", "with", "as", "at", "by", "from", "that",
    "this", "which", "model", "data", "server", "request", "token", "batch", "query", "document", "search",
    "rank", "vector", "space", "cluster", "river", "mountain", "city", "music", "history", "science",
]  # fmt: skip


def corpus(n: int = 512, seed: int = 0) -> list[str]:
    """n sentences: a third short, a third medium, a third long, shuffled."""
    rng = random.Random(seed)
    spans = [(4, 12), (20, 40), (80, 120)]
    out = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*spans[i % 3]))) for i in range(n)]
    rng.shuffle(out)
    return out


def cpu_kind() -> str:
    text = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line), "?")
    flags = (
        f"AVX-512 BF16: {'yes' if 'avx512_bf16' in text else 'no'}",
        f"AMX: {'yes' if 'amx_bf16' in text else 'no'}",
    )
    return f"{name}, {', '.join(flags)}"


def sentence_transformers_rate(
    model: str, sentences: list[str], batch: int, threads: int, dtype: str
) -> float:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    kwargs = {} if dtype == "float32" else {"model_kwargs": {"torch_dtype": getattr(torch, dtype)}}
    st = SentenceTransformer(model, device="cpu", **kwargs)
    st.encode(sentences[:64], batch_size=batch)  # warm
    start = time.perf_counter()
    st.encode(sentences, batch_size=batch)
    return len(sentences) / (time.perf_counter() - start)


def tpserve_rate(port: int, sentences: list[str], batch: int, concurrency: int) -> float:
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    chunks = [sentences[i : i + batch] for i in range(0, len(sentences), batch)]

    def send(chunk: list[str]) -> None:
        body = json.dumps({"input": chunk, "encoding_format": "base64"}).encode()
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, chunks[:concurrency]))  # warm
        start = time.perf_counter()
        list(pool.map(send, chunks))
    return len(sentences) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/minilm")
    p.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    p.add_argument("--sentences", type=int, default=512)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    from common.launcher import running_stack

    sentences = corpus(a.sentences)
    rows = []
    for dtype in a.dtypes:
        st = {b: sentence_transformers_rate(a.model, sentences, b, a.threads, dtype) for b in a.batches}
        flags = ("--http-port", "0", "--num-threads", str(a.threads), "--dtype", dtype)
        with running_stack(a.model, *flags, "--max-num-batched-tokens", "4096") as (info, _):
            for b in a.batches:
                for c in a.concurrency:
                    rate = tpserve_rate(info["http_port"], sentences, b, c)
                    row = {"dtype": dtype, "batch": b, "concurrency": c, "tpserve": rate, "st": st[b]}
                    rows.append(row | {"ratio": rate / st[b]})
    print(f"CPU: {cpu_kind()}; {a.threads} threads each; {len(sentences)} sentences; {a.model}")
    print("| dtype | inputs/request | concurrency | tpserve sent/s | sentence-transformers sent/s | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['batch']} | {r['concurrency']} | {r['tpserve']:.1f} | {r['st']:.1f} | "
            f"{r['ratio']:.2f}x |"
        )
    from shard_worker.devices import cpu_flags, model_dtype

    default = model_dtype("auto", "cpu", cpu_flags(), False)[0]  # what --dtype auto serves in here
    if default in a.dtypes and "float32" in a.dtypes:  # each as loaded by default
        st32 = {r["batch"]: r["st"] for r in rows if r["dtype"] == "float32"}
        print(f"\ntpserve --dtype auto ({default} here) against sentence-transformers' default (float32):")
        for r in rows:
            if r["dtype"] == default:
                ratio = r["tpserve"] / st32[r["batch"]]
                print(f"  {r['batch']} inputs, concurrency {r['concurrency']}: {ratio:.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps({"cpu": cpu_kind(), "threads": a.threads, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
