"""Embedding throughput: tpserve's /v1/embeddings against sentence-transformers in-process, on the same CPU
with the same threads, over one corpus of sentences of mixed length (short, medium, long: 4-12, 20-40 and
80-120 words of a fixed vocabulary, seeded).

sentence-transformers encodes the corpus in batches of 1, 8 and 64 (model.encode(batch_size=b); it runs
one batch at a time, so concurrency does not apply to it). tpserve gets the corpus as requests of 1, 8
and 64 inputs, at concurrency 1 to 32 (requests in flight), through its HTTP server: the router tokenizes,
the scheduler batches the inputs of every request in flight under --max-num-batched-tokens, the worker
runs them. The two never run at once (sentence-transformers first, then the stack). Prints one table:
sentences per second, and tpserve's over sentence-transformers' at the same batch size; with the CPU
(model name, whether it has AVX-512 BF16) and the threads. A benchmark, not a test: ratios in one run.

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
    return f"{name}, AVX-512 BF16: {'yes' if 'avx512_bf16' in text else 'no'}"


def sentence_transformers_rate(model: str, sentences: list[str], batch: int, threads: int) -> float:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(model, device="cpu")
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
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    from common.launcher import running_stack

    sentences = corpus(a.sentences)
    st = {b: sentence_transformers_rate(a.model, sentences, b, a.threads) for b in a.batches}
    flags = (
        "--http-port",
        "0",
        "--num-threads",
        str(a.threads),
        "--dtype",
        "float32",
        "--linear-dtype",
        "dtype",
    )
    rows = []
    with running_stack(a.model, *flags, "--max-num-batched-tokens", "4096") as (info, _):
        for b in a.batches:
            for c in a.concurrency:
                rate = tpserve_rate(info["http_port"], sentences, b, c)
                rows.append(
                    {"batch": b, "concurrency": c, "tpserve": rate, "st": st[b], "ratio": rate / st[b]}
                )
    print(f"CPU: {cpu_kind()}; {a.threads} threads each; {len(sentences)} sentences; {a.model}")
    print("| inputs/request | concurrency | tpserve sent/s | sentence-transformers sent/s | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['concurrency']} | {r['tpserve']:.1f} | {r['st']:.1f} | {r['ratio']:.2f}x |"
        )
    if a.out:
        Path(a.out).write_text(json.dumps({"cpu": cpu_kind(), "threads": a.threads, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
