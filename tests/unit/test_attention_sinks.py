"""gpt-oss's attention sinks (a learned logit per head in the softmax's denominator) in the backend that
serve them (reference; cpu: its C++ kernel for short queries, the reference's path for prefill chunks),
against a naive float64 attention with the sink written out, on random steps with and without sliding
windows, in the dtypes each serves; flex (compiled CPU flex returns no log-sum-exp) refuses such a layer."""

from __future__ import annotations

import math
import random

import pytest
import torch

from shard_worker.attention import Attention, select_backend
from tests.unit.test_attention import BLOCK_SIZE, CPU, TOLERANCE, random_step

torch.set_flush_denormal(True)


def naive_with_sinks(step, q, cache, scale, window, sinks) -> torch.Tensor:
    q, cache, sinks = q.double(), cache.double(), sinks.double()
    heads, kvh = q.shape[1], cache.shape[3]
    out = torch.zeros_like(q)
    row = 0
    for q_len, c_len, table in zip(step.query_lens, step.context_lens, step.tables, strict=True):
        slots = [table[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(c_len)]
        keys = cache[0].reshape(-1, kvh, cache.shape[-1])[slots]
        values = cache[1].reshape(-1, kvh, cache.shape[-1])[slots]
        for i in range(q_len):
            p = c_len - q_len + i
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(heads):
                g = h // (heads // kvh)
                scores = keys[lo : p + 1, g] @ q[row, h] * scale
                weights = torch.softmax(torch.cat([scores, sinks[h : h + 1]]), 0)[:-1]
                out[row, h] = weights @ values[lo : p + 1, g]
            row += 1
    return out


@pytest.mark.parametrize(
    "backend,dtype",
    [
        ("reference", torch.float32),
        ("reference", torch.float64),
        ("cpu", torch.float32),
        ("cpu", torch.bfloat16),
    ],
    ids=str,
)
@pytest.mark.parametrize("window", [None, 20])
def test_sinks_match_naive_attention(backend, dtype, window):
    rng = random.Random(f"{backend}{window}")
    heads, kv_heads, d = 8, 2, 16
    for seed in range(2):
        step = random_step(rng, 400, max_context=100)
        gen = torch.Generator().manual_seed(seed)
        t = sum(step.query_lens)
        q, k, v = (torch.randn(t, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
        cache = torch.full((2, 400, BLOCK_SIZE, kv_heads, d), math.nan)
        used = sorted({b for table in step.tables for b in table})
        cache[:, used] = torch.randn(2, len(used), BLOCK_SIZE, kv_heads, d, generator=gen)
        # Sinks from far below the scores (no effect) to far above (they take most of the weight).
        sinks = torch.linspace(-6.0, 6.0, heads)
        layer = Attention(heads, kv_heads, d, d**-0.5, sliding_window=window)
        layer.sinks = sinks.to(dtype)
        b = select_backend(backend, CPU, dtype)
        batch = step.batch(width_pad=2)
        with torch.inference_mode():
            out = layer(q.to(dtype), k.to(dtype), v.to(dtype), cache.to(dtype), b.context(batch))
        written = cache.clone().view(2, -1, kv_heads, d)
        written[0, batch.slot_mapping], written[1, batch.slot_mapping] = k, v
        want = naive_with_sinks(step, q, written.view_as(cache), d**-0.5, window, sinks)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
        if backend == "cpu":  # the per-call path too (fp8 caches take it), over the cache now written
            with torch.inference_mode():
                again = b.attend(layer, q.to(dtype), written.view_as(cache).to(dtype), b.context(batch))
            torch.testing.assert_close(again.double(), want, rtol=tol, atol=tol)
        without = naive_with_sinks(step, q, written.view_as(cache), d**-0.5, window, sinks - 1e9)
        assert not torch.allclose(want, without, atol=1e-3)  # the sinks changed the output


def test_backends_without_sinks_refuse_them():
    layer = Attention(4, 2, 16, 0.25)
    layer.sinks = torch.zeros(4)
    assert "sinks" in select_backend("flex", CPU, torch.float32).refusal(layer)
    for name in ("cpu", "reference"):
        assert select_backend(name, CPU, torch.float32).refusal(layer) is None
    assert select_backend("cpu", CPU, torch.float32).refusal(Attention(4, 2, 16, 0.25)) is None
