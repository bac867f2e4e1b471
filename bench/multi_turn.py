"""A multi-turn chat workload on several replicas: cache-aware routing against the others.

Many conversations, each over one of a few shared system prompts; every turn resends the whole history
(system prompt, earlier user messages and the model's answers) plus a new user message, as chat clients
do. Each routing policy gets its own stack (`tpserve launch --replicas N --enable-prefix-caching
--routing-policy P`), the same conversations (seeded), and the same offered load (a fixed number of
conversations in flight). Reported per policy: TTFT p50/p99, output tokens/s, and the prefix hit rate
(cached prompt tokens / prompt tokens, from each request's Usage.cached_tokens).

    python -m bench.multi_turn --model models/small --policies cache_aware,least_loaded,round_robin

The prefix cache's host tier (--host-prefix-cache), on and off, over a deliberately small device cache
(`--host-tier both`; `--device-share 0.33` sizes each replica's device cache to that share of the
working set, the blocks of every conversation's final history and the system prompts, over the
replicas; host memory is --swap-space GiB per rank):

    python -m bench.multi_turn --replicas 1 --policies cache_aware --host-tier both --device-share 0.33 \
        --system-tokens 128 --turns 6 --max-new-tokens 32 --concurrency 24 --max-num-seqs 4

(every conversation in flight and 4 sequences running: a conversation's next turn comes after the
others', so what it left on the device is gone by then unless the device holds the working set).

Ratios within one run are what to read: on a shared CPU the absolute figures move with the neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import grpc

from common.launcher import running_stack
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc


def conversations(args, vocab: int) -> list[tuple[list[int], list[list[int]]]]:
    """(system prompt, user messages) per conversation; the same for every policy."""
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(3, vocab) for _ in range(args.system_tokens)] for _ in range(args.system_prompts)
    ]
    return [
        (
            systems[i % len(systems)],
            [[rng.randrange(3, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)],
        )
        for i in range(args.conversations)
    ]


async def one_turn(stub, prompt: list[int], max_new: int) -> tuple[float, list[int], int]:
    """(TTFT in seconds, the answer's tokens, cached prompt tokens)."""
    start, ttft, tokens, cached = time.perf_counter(), None, [], 0
    req = pb.GenerateRequest(
        token_ids=prompt, max_new_tokens=max_new, ignore_eos=True, sampling=pb.SamplingParams(temperature=0)
    )
    async for resp in stub.Generate(req, timeout=600):
        if resp.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        tokens += resp.token_ids
        if resp.HasField("usage"):
            cached = resp.usage.cached_tokens
    return ttft, tokens, cached


async def run_policy(target: str, convs, args) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        ttfts, prompt_tokens, cached_tokens, out_tokens = [], 0, 0, 0
        slots = asyncio.Semaphore(args.concurrency)

        async def conversation(system, users):
            nonlocal prompt_tokens, cached_tokens, out_tokens
            async with slots:
                history = list(system)
                for user in users:
                    history += user
                    ttft, answer, cached = await one_turn(stub, history, args.max_new_tokens)
                    ttfts.append(ttft)
                    prompt_tokens += len(history)
                    cached_tokens += cached
                    out_tokens += len(answer)
                    history += answer

        start = time.perf_counter()
        await asyncio.gather(*(conversation(s, u) for s, u in convs))
        wall = time.perf_counter() - start
        stats = await stub.GetStats(pb.StatsRequest())
    q = statistics.quantiles(ttfts, n=100)
    return dict(
        ttft_p50_ms=1000 * statistics.median(ttfts),
        ttft_p99_ms=1000 * q[98],
        output_tok_s=out_tokens / wall,
        hit_rate=cached_tokens / prompt_tokens,
        routed={r.replica.rpartition(":")[2]: r.routed_total for r in stats.replicas},
        wall_s=wall,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/small")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policies", default="cache_aware,least_loaded,round_robin")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=6, help="conversations in flight at once")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="per replica (16 tokens each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=0, help="per replica (0: the scheduler's default)")
    p.add_argument("--host-tier", choices=("off", "on", "both"), default="off", help="--host-prefix-cache")
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB per rank, with --host-tier")
    p.add_argument(
        "--device-share",
        type=float,
        default=0.0,
        help="size the device cache to this share of the working set",
    )
    args = p.parse_args()
    if args.device_share:
        system_blocks = args.system_prompts * -(-args.system_tokens // 16)
        turn_blocks = args.conversations * args.turns * (args.user_tokens + args.max_new_tokens) // 16
        working_set = system_blocks + turn_blocks
        args.num_kv_blocks = max(1, int(args.device_share * working_set / args.replicas))
        print(f"working set {working_set} blocks; device cache {args.num_kv_blocks} blocks per replica")
    rows = {}
    tiers = {"off": ("off",), "on": ("on",), "both": ("off", "on")}[args.host_tier]
    for policy, tier in ((p, t) for p in args.policies.split(",") for t in tiers):
        flags = ("--replicas", str(args.replicas), "--enable-prefix-caching", "--routing-policy", policy)
        flags += ("--num-kv-blocks", str(args.num_kv_blocks), "--max-num-batched-tokens", "2048")
        if args.max_num_seqs:
            flags += ("--max-num-seqs", str(args.max_num_seqs))
        if args.host_tier != "off":  # the same swap space both ways: only the tier differs
            flags += ("--swap-space", str(args.swap_space)) + (
                ("--host-prefix-cache",) if tier == "on" else ()
            )
        name = policy if args.host_tier == "off" else f"{policy}, host tier {tier}"
        with running_stack(args.model, *flags) as (info, _):
            vocab = int(info.get("vocab_size", 0)) or 1000
            convs = conversations(args, min(vocab, 1000))
            # One turn first, so that no policy pays the stack's warm-up in its figures.
            asyncio.run(
                run_policy(info["target"], convs[:1], argparse.Namespace(**{**vars(args), "turns": 1}))
            )
            rows[name] = asyncio.run(run_policy(info["target"], convs, args))
        print(name, rows[name], flush=True)
    print("\n| policy | TTFT p50 ms | TTFT p99 ms | output tok/s | prefix hit rate | routed per replica |")
    print("|---|---|---|---|---|---|")
    for policy, r in rows.items():
        routed = ", ".join(str(v) for v in r["routed"].values())
        print(
            f"| {policy} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['output_tok_s']:.1f} | "
            f"{r['hit_rate']:.2f} | {routed} |"
        )


if __name__ == "__main__":
    main()
