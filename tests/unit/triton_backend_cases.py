"""Cases for tests/unit/test_triton_backend.py: the Triton attention backend and the decode graphs' padded
replay path, run under Triton's interpreter on CPU.

Run as `TRITON_INTERPRET=1 python tests/unit/triton_backend_cases.py CASE...` (one process per test: the
variable must be set before the kernels are imported, and an out-of-bounds access segfaults). Prints one
JSON line per check ({"case", "check", "max_err", "tol", "ok"}) and exits 1 if any fails.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("set TRITON_INTERPRET=1: the kernels run on CPU tensors only under Triton's interpreter")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.sampling import SamplingConfig  # noqa: E402
from shard_worker.attention import Attention, StepBatch, select_backend  # noqa: E402
from shard_worker.model_runner import ModelRunner  # noqa: E402
from shard_worker.parallel import TensorParallel  # noqa: E402
from shard_worker.step import SequenceInit, StepInputs  # noqa: E402
from tests.unit.interpreted import run_cases  # noqa: E402
from tests.unit.test_attention import BLOCK_SIZE, CPU, Step, naive_attention, random_step  # noqa: E402

torch.set_flush_denormal(True)
RESULTS: list[dict] = []
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3}
GREEDY = SamplingConfig(temperature=0.0)


def record(case: str, check: str, max_err: float, tol: float) -> None:
    RESULTS.append({"case": case, "check": check, "max_err": float(max_err), "tol": tol})


def attend(backend, step: Step, heads, kv_heads, head_dim, dtype, num_blocks, seed, window=None):
    """(the backend's output, the float64 naive one, the metadata) on random q/k/v over a cache whose
    unused blocks are NaN."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(step.query_lens)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    cache = torch.full((2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), float("nan"))
    used = sorted({b for table in step.tables for b in table})
    cache[:, used] = torch.randn(2, len(used), BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    # Rounded to dtype first, so that the reference sees the values the kernel does.
    q, k, v, cache = (x.to(dtype).double() for x in (q, k, v, cache))
    batch = step.batch(width_pad=2)
    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
    ctx = backend.context(batch)
    with torch.inference_mode():
        out = layer(q.to(dtype), k.to(dtype), v.to(dtype), cache.to(dtype), ctx)
    written = cache.clone().view(2, -1, kv_heads, head_dim)
    written[0, batch.slot_mapping], written[1, batch.slot_mapping] = k, v
    ref = naive_attention(step, q, written.view(cache.shape), head_dim**-0.5, window)
    return out, ref, ctx.metadata


def case_random_steps() -> None:
    """Decodes, prompts, chunks after cached context, shared prefixes and scrambled blocks, through the
    backend's metadata, with GQA groups of 1, 2 and 4 and sliding windows."""
    rng = random.Random(5)
    for dtype in (torch.float32, torch.float16):
        backend = select_backend("triton", CPU, dtype)
        for heads, kv_heads, head_dim, window in [(4, 4, 16, None), (8, 2, 64, None), (4, 2, 32, 5)]:
            step = random_step(rng, 160, max_context=70)
            out, ref, _ = attend(backend, step, heads, kv_heads, head_dim, dtype, 160, seed=1, window=window)
            err = (out.double() - ref).abs().max().item()
            record("random_steps", f"{heads}/{kv_heads}x{head_dim} window={window}", err, TOLERANCE[dtype])


def case_split_workspace() -> None:
    """Few long decodes on a GPU-sized SM count split their keys: the result is unchanged, the workspace
    is what that step's tokens need (not more), and a later bigger split gets a new buffer while the
    first step's metadata keeps its own (as a captured graph would)."""
    backend = select_backend("triton", CPU, torch.float32)
    backend.num_sms = 64
    lens = [(1, 600), (1, 530)]
    tables = [list(range(40 * i, 40 * i + -(-c // BLOCK_SIZE))) for i, (_, c) in enumerate(lens)]
    step = Step([q for q, _ in lens], [c for _, c in lens], tables)
    out, ref, md = attend(backend, step, 4, 2, 16, torch.float32, 80, seed=2)
    record("split_workspace", "split decodes", (out.double() - ref).abs().max().item(), 2e-5)
    ((splits, workspace),) = md.plans.values()
    from shard_worker.attention.kernels import kv_split_workspace_numel

    record("split_workspace", f"{splits} splits", 0.0 if splits == 2 else 1.0, 0.0)
    needed = kv_split_workspace_numel(2, 4, 16, splits)
    record("split_workspace", "workspace = the step's need", abs(workspace.numel() - needed), 0.0)
    longer = Step([1], [1000], [list(range(-(-1000 // BLOCK_SIZE)))])
    out, ref, md2 = attend(backend, longer, 16, 1, 16, torch.float32, 80, seed=3)
    record("split_workspace", "a longer split decode", (out.double() - ref).abs().max().item(), 2e-5)
    ((_, bigger),) = md2.plans.values()
    record("split_workspace", "new buffer, old one kept", 0.0 if bigger is not workspace else 1.0, 0.0)


def case_sinks() -> None:
    """gpt-oss's sinks (tests/unit/test_attention_sinks.py's naive reference): mixed steps with and
    without a window, and split long decodes, where the combine kernel alone adds them."""
    from tests.unit.test_attention_sinks import naive_with_sinks

    rng = random.Random(11)
    backend = select_backend("triton", CPU, torch.float32)
    heads, kv_heads, d = 8, 2, 16
    sinks = torch.linspace(-6.0, 6.0, heads)
    steps = [(random_step(rng, 160, max_context=70), None, 1), (random_step(rng, 160, max_context=70), 20, 1)]
    lens = [(1, 600), (1, 530)]
    tables = [list(range(40 * i, 40 * i + -(-c // BLOCK_SIZE))) for i, (_, c) in enumerate(lens)]
    steps.append((Step([q for q, _ in lens], [c for _, c in lens], tables), None, 64))
    for i, (step, window, num_sms) in enumerate(steps):
        backend.num_sms = num_sms  # 64: the long decodes split their keys
        gen = torch.Generator().manual_seed(i)
        t = sum(step.query_lens)
        q, k, v = (torch.randn(t, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
        cache = torch.full((2, 160, BLOCK_SIZE, kv_heads, d), float("nan"))
        used = sorted({b for table in step.tables for b in table})
        cache[:, used] = torch.randn(2, len(used), BLOCK_SIZE, kv_heads, d, generator=gen)
        layer = Attention(heads, kv_heads, d, d**-0.5, sliding_window=window)
        layer.sinks = sinks
        batch = step.batch(width_pad=2)
        ctx = backend.context(batch)
        with torch.inference_mode():
            out = layer(q, k, v, cache, ctx)
        splits = [p[0] for p in ctx.metadata.plans.values()]
        written = cache.clone().view(2, -1, kv_heads, d)
        written[0, batch.slot_mapping], written[1, batch.slot_mapping] = k, v
        want = naive_with_sinks(step, q, written.view_as(cache), d**-0.5, window, sinks)
        err = (out.double() - want).abs().max().item()
        record("sinks", f"window={window} splits={splits}", err, 2e-5)


def decode_step(rng: random.Random, num_seqs: int, num_blocks: int, max_context: int) -> StepInputs:
    """One decode per sequence over scrambled blocks (the cache's last block, reserved, never used)."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    contexts = [rng.randint(1, max_context) for _ in range(num_seqs)]
    tables = [[pool.pop() for _ in range(-(-c // BLOCK_SIZE))] for c in contexts]
    return StepInputs(
        seq_ids=list(range(num_seqs)),
        query_lens=[1] * num_seqs,
        context_lens=contexts,
        sample_counts=[1] * num_seqs,
        input_ids=[rng.randrange(2, 1000) for _ in range(num_seqs)],
        block_table=StepInputs.pad_tables(tables),
    )


def case_graph_buckets() -> None:
    """The tiny model's decode steps replayed through every bucket's padded static buffers (capture off:
    the same code minus torch.cuda.graph) give the logits and greedy tokens of the unpadded eager step,
    for batch sizes at and between the buckets, with graph-bucket split counts (GPU-sized SM count)."""
    runner = ModelRunner(
        ROOT / "models" / "tiny", torch.float32, CPU, TensorParallel(), "auto", "triton", True
    )
    # Plan KV splits as a GPU would: the small buckets' loose bounds (max_model_len) then split.
    runner.attention.num_sms = 8
    num_blocks = 200
    runner.allocate_kv_cache(num_blocks, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:  # a cache full of keys and values, as after many prefills
        cache.copy_(torch.randn(cache.shape, generator=gen) * 0.5)
    runner.capture_cuda_graphs(max_num_seqs=8, max_model_len=1024)
    graphs = runner.graphs
    reserved = runner.kv_caches[0].shape[1] - num_blocks
    record("graph_buckets", "one reserved block past the scheduler's", abs(reserved - 1), 0.0)
    splits = {size: [p[0] for p in ctx.metadata.plans.values()] for size, ctx in graphs._contexts.items()}
    record("graph_buckets", f"split counts per bucket {splits}", 0.0 if splits[1] == [4] else 1.0, 0.0)
    record("graph_buckets", f"buckets {graphs.sizes}", 0.0 if graphs.sizes == (1, 2, 4, 8) else 1.0, 0.0)
    rng = random.Random(1)
    # Every bucket, most of them padded, and a small step after a large one (stale rows reset).
    for num_seqs in (1, 2, 3, 7, 2):
        inputs = decode_step(rng, num_seqs, num_blocks, max_context=50)
        batch = StepBatch.build(
            inputs.input_ids, inputs.query_lens, inputs.context_lens, inputs.block_table, BLOCK_SIZE, CPU
        )
        with torch.inference_mode():
            eager = runner.model(
                batch.input_ids, batch.positions, runner.attention.context(batch), runner.kv_caches
            )
            replayed = graphs.replay(batch).clone()
            logits = runner.model.compute_logits(eager), runner.model.compute_logits(replayed)
        bucket = graphs.bucket(batch)
        record(
            "graph_buckets",
            f"{num_seqs} seqs in bucket {bucket}: logits",
            (logits[0] - logits[1]).abs().max(),
            1e-4,
        )
        same = torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
        record("graph_buckets", f"{num_seqs} seqs in bucket {bucket}: tokens", 0.0 if same else 1.0, 0.0)
    # Through execute: greedy tokens with graphs equal those without.
    tokens = {}
    for use_graphs in (True, False):
        runner.graphs = graphs if use_graphs else None
        inputs = decode_step(random.Random(9), 6, num_blocks, max_context=60)
        states = [runner.sampler.new_state(SequenceInit(s, GREEDY, 0, [3], 1)) for s in range(6)]
        tokens[use_graphs] = runner.execute(inputs, states).token_ids
    record("graph_buckets", "execute: greedy tokens", 0.0 if tokens[True] == tokens[False] else 1.0, 0.0)
    not_decode = StepBatch.build(np.zeros(3, dtype=np.int64), np.array([2, 1]), np.array([2, 5]),
                                 np.array([[0], [1]]), BLOCK_SIZE, CPU)  # fmt: skip
    record(
        "graph_buckets", "a prefill is not replayed", 0.0 if graphs.replay(not_decode) is None else 1.0, 0.0
    )
    # Profiling leaves the reserved block out of what the scheduler is told.
    block_bytes = runner.kv_block_bytes(BLOCK_SIZE)
    told = runner.profile_num_blocks(BLOCK_SIZE, 16, 0.9, 0.0005, max_num_seqs=2, max_model_len=32)
    record(
        "graph_buckets",
        "profiled blocks exclude the reserved one",
        abs(told - (2**30 * 0.0005 // block_bytes - 1)),
        0.0,
    )


if __name__ == "__main__":
    sys.exit(run_cases(globals(), RESULTS, sys.argv[1:]))
