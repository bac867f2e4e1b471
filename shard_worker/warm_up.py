"""What a worker runs before it serves, so that nothing compiles or initialises on a request's path.

Two parts. The attention kernels need the layers' shapes, not the weights: KernelWarmUp compiles them
(or loads them from the compile cache, shard_worker/startup.py) on a thread as soon as the model's layers
exist, while the main thread reads the checkpoint. ModelRunner.warm_up then waits for it and runs the
whole model over the same steps (sampling, the linear layers' first shapes), which no longer compiles.
Through the backend's interface (prepare, forward), so whatever a backend compiles is covered.

Then measure_speed times a long prompt and decode steps at a few batch sizes, warm: what the router's
admission needs before any request has measured the replica (common/speed.py).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

import torch

from common.speed import StackSpeed
from shard_worker.attention import Attention, AttentionBackend, StepBatch
from shard_worker.attention.flex import PREFILL_MIN_QUERY
from shard_worker.capacity import synthetic_step
from shard_worker.startup import install_vec_isa_probe

log = logging.getLogger("tpserve.shard_worker")

# The block size the kernels are warmed with before the scheduler says which it uses (its default,
# scheduler/config.py). Another one is warmed by ModelRunner.warm_up when the scheduler describes it.
EARLY_BLOCK_SIZE = 16
# Backends whose kernels torch.compile builds, for which inductor's instruction-set probe is set up
# (shard_worker/startup.py); the cpu backend's library is built once per machine by its own module.
COMPILED_BY_INDUCTOR = ("flex",)
SWITCH_INTERVAL_S = 0.0005
# measure_speed: the prompt timed for the prefill rate (long enough that a step's fixed cost is a small
# part), the context of the decode steps timed (a short one: the router's bias corrects for longer), and
# how many times each step runs (their mean is kept; a mean, as a neighbour's burst is part of the speed).
SPEED_PROMPT_TOKENS = 256
SPEED_CONTEXT = 17
SPEED_RUNS = 2


def warm_up_steps(block_size: int, max_len: int) -> list[list[tuple[int, int]]]:
    """The (query_len, context_len) sequences of each warm-up step: a prompt (block tiles) beside a
    decode (one-token tiles); then one sequence's short prompt, then its decode (the in-order one-token
    layout a first request brings). Flex compiles each tiling once with dynamic shapes, so later sizes
    reuse these kernels."""
    prompt_len = min(PREFILL_MIN_QUERY + block_size, max_len)
    short = min(PREFILL_MIN_QUERY - 1, max_len)
    return [
        [(1, min(block_size + 1, max_len)), (prompt_len, prompt_len)],
        [(short, short)],
        [(1, min(short + 1, max_len))],
    ]


def speed_batch_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The decode batches measure_speed times: 1, 4, 16, ... below the largest batch a step may carry,
    and that one (few sizes: each costs start-up time; StackSpeed interpolates between them)."""
    largest = max(1, min(max_num_seqs, max_num_batched_tokens))
    sizes, n = [], 1
    while n < largest:
        sizes.append(n)
        n *= 4
    return [*sizes, largest]


def measure_speed(
    run: Callable[[list[tuple[int, int]]], float],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_len: int,
) -> StackSpeed:
    """The replica's speed on this rank: run(lens) runs one step of (query_len, context_len) sequences
    and returns its seconds (ModelRunner.run_synthetic). Every rank runs the same steps in the same
    order (their collectives pair up)."""

    def mean(lens: list[tuple[int, int]]) -> float:
        return sum(run(lens) for _ in range(SPEED_RUNS)) / SPEED_RUNS

    prompt = max(1, min(SPEED_PROMPT_TOKENS, max_num_batched_tokens, max_len))
    context = max(1, min(SPEED_CONTEXT, max_len))
    decode = tuple(
        (n, mean([(1, context)] * n)) for n in speed_batch_sizes(max_num_seqs, max_num_batched_tokens)
    )
    return StackSpeed(prompt / mean([(prompt, prompt)]), decode)


def attention_kinds(model: torch.nn.Module) -> list[Attention]:
    """One attention layer of each kind in the model (heads, head_dim, scale, window): what a kernel is
    compiled for. SmolLM2's 30 layers are one kind; Gemma 3's sliding and global layers two."""
    kinds: dict[tuple, Attention] = {}
    for layer in model.modules():
        if isinstance(layer, Attention):
            key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale, layer.sliding_window)
            kinds.setdefault(key, layer)
    return list(kinds.values())


def warm_attention(
    backend: AttentionBackend,
    model: torch.nn.Module,
    block_size: int,
    max_len: int,
    kv_dtype: torch.dtype,
) -> None:
    """Runs each kind of attention layer of model over the warm-up steps, on zeros, as a step would run
    them: keys and values in a scratch cache made like the model's (model.new_kv_caches, outside
    inference mode, as ModelRunner allocates it), the rest under inference mode (ModelRunner.execute),
    so that the kernels' guards see the same kinds of tensors."""
    layers = attention_kinds(model)
    device, dtype = backend.device, backend.dtype
    for lens in warm_up_steps(block_size, max_len):
        step, num_blocks = synthetic_step(lens, block_size)
        (cache,) = model.new_kv_caches(num_blocks, block_size, kv_dtype, device)[:1]
        with torch.inference_mode():
            batch = StepBatch.build(
                step.input_ids, step.query_lens, step.context_lens, step.block_table, block_size, device
            )
            ctx = backend.context(batch)
            tokens = batch.num_tokens
            for layer in layers:
                q = torch.zeros(tokens, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
                k = torch.zeros(tokens, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device)
                backend.forward(layer, q, k, torch.zeros_like(k), cache, ctx)


class KernelWarmUp:
    """warm_attention on a thread of its own, from start() until wait(). A failure is logged, not
    raised: ModelRunner.warm_up compiles whatever is missing and fails there if it must."""

    def __init__(self, backend: AttentionBackend, model: torch.nn.Module, kv_dtype: torch.dtype):
        self.seconds: float | None = None  # how long it took, once done
        self.error: BaseException | None = None
        self._args = (backend, model, EARLY_BLOCK_SIZE, model.config.max_position_embeddings, kv_dtype)
        self._thread = threading.Thread(target=self._run, name="kernel-warm-up", daemon=True)

    def start(self) -> KernelWarmUp:
        # The main thread loads the weights meanwhile: torch calls that release the GIL, between short
        # stretches of Python that need it back. At the default 5 ms switch interval each of those waited
        # on this thread's tracing (SmolLM2's load 2 s -> 5 s); 0.5 ms while it runs.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if self._args[0].name in COMPILED_BY_INDUCTOR:
                # Floats specialised in this thread's compiles (torch 2.13 keeps dynamo's settings per
                # thread): the only float a kernel takes is its layer's constant scale, which dynamo
                # otherwise traces as an input, then specialises and traces again (1.5-2 s of each start,
                # warm cache or not). Only for these backends: importing dynamo (2 s) on this thread while
                # the main thread imports too once failed half-way (an op its module registers missing).
                torch._dynamo.config.specialize_float = True
                install_vec_isa_probe()  # importing inductor: 1.8 s, off the main thread
            warm_attention(*self._args)
        except Exception as e:  # noqa: BLE001 (reported by wait(), and retried by the full warm-up)
            self.error = e
        self.seconds = time.perf_counter() - start
        sys.setswitchinterval(self._switch_interval)

    def wait(self) -> float:
        """Blocks until the thread is done; returns the seconds waited."""
        start = time.perf_counter()
        self._thread.join()
        if self.error is not None:
            log.warning(
                "compiling the attention kernels while the weights loaded failed (%s: %s); the warm-up "
                "compiles them",
                type(self.error).__name__,
                self.error,
            )
        return time.perf_counter() - start
