"""Gated DeltaNet (shard_worker/model/layers/gated_deltanet.py) against transformers' torch fallbacks
(models/qwen3_next): the chunked rule, the recurrent update, the short convolution, each with a state
carried in; a prefill split in chunks equals it whole; and the whole layer, at TP 1 and sharded over 2
ranks by hand, equals transformers' Qwen3NextGatedDeltaNet (and Qwen3.5's, its projections split) over a
prefill and then decode tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref35
from transformers.models.qwen3_next import modeling_qwen3_next as ref

from shard_worker.model.layers.gated_deltanet import (
    GatedDeltaNet,
    SplitGatedDeltaNet,
    StateStep,
    causal_conv,
    causal_conv_step,
    chunked_delta_rule,
    recurrent_delta_rule,
)
from shard_worker.parallel import TensorParallel

torch.set_flush_denormal(True)
HK, HV, DK, DV = 2, 4, 8, 16


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def inputs(tokens: int, batch: int = 1, seed: int = 0):
    q, k = rand(batch, tokens, HK, DK, seed=seed), rand(batch, tokens, HK, DK, seed=seed + 1)
    v = rand(batch, tokens, HV, DV, seed=seed + 2)
    g = -torch.rand(batch, tokens, HV, generator=torch.Generator().manual_seed(seed + 3))
    beta = torch.rand(batch, tokens, HV, generator=torch.Generator().manual_seed(seed + 4))
    return q, k, v, g, beta


@pytest.mark.parametrize("tokens", [1, 37, 64, 130])
def test_chunked_rule_equals_transformers_from_a_state(tokens):
    q, k, v, g, beta = inputs(tokens)
    state = rand(1, HV, DK, DV, seed=9)
    want, want_state = ref.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, new_state = chunked_delta_rule(q[0], k[0], v[0], g[0], beta[0], state[0])
    torch.testing.assert_close(out, want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(new_state, want_state[0], rtol=1e-4, atol=1e-4)


def test_prefill_in_chunks_carries_the_state():
    q, k, v, g, beta = (t[0] for t in inputs(100))
    state = torch.zeros(HV, DK, DV)
    whole, whole_state = chunked_delta_rule(q, k, v, g, beta, state)
    first, mid = chunked_delta_rule(q[:45], k[:45], v[:45], g[:45], beta[:45], state)
    second, end = chunked_delta_rule(q[45:], k[45:], v[45:], g[45:], beta[45:], mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(end, whole_state, rtol=1e-4, atol=1e-4)


def test_recurrent_update_equals_transformers_for_a_batch():
    q, k, v, g, beta = inputs(1, batch=3)
    state = rand(3, HV, DK, DV, seed=5)
    want, want_state = ref.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, new_state = recurrent_delta_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    torch.testing.assert_close(out, want[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_state, want_state, rtol=1e-5, atol=1e-5)


def test_short_convolution_carries_its_state():
    channels, kernel, tokens = 6, 4, 9
    x, weight = rand(tokens, channels, seed=1), rand(channels, kernel, seed=2)
    want = ref.causal_conv1d_fn(x.t().unsqueeze(0), weight, activation="silu")[0].t()
    state = torch.zeros(channels, kernel - 1)
    first, state = causal_conv(x[:2], state, weight)  # shorter than the kernel
    second, state = causal_conv(x[2:7], state, weight)
    outs = [first, second]
    for t in range(7, tokens):  # then one token at a time, as decode does
        out, batched = causal_conv_step(x[t : t + 1], state.unsqueeze(0), weight)
        outs.append(out)
        state = batched[0]
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-5, atol=1e-5)
    # and the decode form against transformers' update
    conv_state = rand(2, channels, kernel - 1, seed=3)
    step = rand(2, channels, seed=4)
    out, new = causal_conv_step(step, conv_state, weight)
    expect_state = conv_state.clone()
    expect = ref.causal_conv1d_update(step.unsqueeze(2), expect_state, weight, activation="silu")[:, :, 0]
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(new, expect_state)


def _config(config_class=Qwen3NextConfig):
    return config_class(
        hidden_size=32,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )


def _reference_layer(qwen3_5: bool):
    torch.manual_seed(0)
    if qwen3_5:
        layer = ref35.Qwen3_5GatedDeltaNet(_config(Qwen3_5TextConfig), 0).eval()
    else:
        layer = ref.Qwen3NextGatedDeltaNet(_config(), 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer


def _ours(layer, tp, qwen3_5: bool):
    ours = (SplitGatedDeltaNet if qwen3_5 else GatedDeltaNet)(32, HK, HV, DK, DV, 4, 1e-6, tp)
    params = dict(ours.named_parameters())
    for name, tensor in layer.state_dict().items():
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, None)
        else:
            param.data.copy_(tensor)
    return ours


@pytest.mark.parametrize("qwen3_5", [False, True], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("ws", [1, 2])
def test_layer_equals_transformers_through_slots(ws, qwen3_5):
    """Two sequences in slots 3 and 0: a prefill of 5 and 11 tokens, then 3 decode steps, the state
    kept in the slot caches between steps. With 2 ranks each holds its heads' slots; the out_proj
    partial sums add up to the whole."""
    layer = _reference_layer(qwen3_5)
    lens = [5, 11]
    x = [rand(n + 3, 32, seed=10 + i) for i, n in enumerate(lens)]
    want = []
    for xi, n in zip(x, lens, strict=True):
        cache = DynamicCache(config=_config(Qwen3_5TextConfig if qwen3_5 else Qwen3NextConfig))
        with torch.no_grad():
            outs = [layer(xi[None, :n], cache=cache)]
            outs += [layer(xi[None, t : t + 1], cache=cache) for t in range(n, n + 3)]
        want.append(torch.cat(outs, dim=1)[0])
    total = None
    for rank in range(ws):
        tp = TensorParallel(rank=rank, world_size=ws)
        tp.all_reduce = lambda t: t  # this rank's partial sum; summed below
        ours = _ours(layer, tp, qwen3_5)
        conv_shape, delta_shape = ours.state_shapes()
        cache = (torch.full((4, *conv_shape), float("nan")), torch.full((4, *delta_shape), float("nan")))
        slots = np.array([3, 0])
        got = [[], []]
        with torch.no_grad():
            step = StateStep.build(np.array(lens), np.array(lens), slots, "cpu")
            out = ours(torch.cat([xi[:n] for xi, n in zip(x, lens, strict=True)]), step, cache)
            got[0].append(out[: lens[0]])
            got[1].append(out[lens[0] :])
            for t in range(3):
                ctx = np.array([n + t + 1 for n in lens])
                step = StateStep.build(np.array([1, 1]), ctx, slots, "cpu")
                out = ours(torch.stack([xi[n + t] for xi, n in zip(x, lens, strict=True)]), step, cache)
                got[0].append(out[:1])
                got[1].append(out[1:])
        result = [torch.cat(g) for g in got]
        total = result if total is None else [a + b for a, b in zip(total, result, strict=True)]
    for i in range(2):
        torch.testing.assert_close(total[i], want[i], rtol=1e-4, atol=1e-4)
