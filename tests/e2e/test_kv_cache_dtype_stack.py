"""--kv-cache-dtype through the real processes on the tiny model (float32, the default cpu backend), with
prefix caching, preemption and swap, one server start per dtype:
greedy tokens equal transformers' with the same rounding (keys and values rounded to the cache's dtype as
they enter its cache, after rotary embedding, which is what our cache stores; fp8 saturated to its range,
as ours is). The rounding is what the comparison sees: for fp8_e4m3 the test first checks that e5m2's
rounding gives other tokens on these prompts, so a server that stored e5m2 would fail it.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.e2e.test_observability import scrape
from tests.reference import GREEDY, MAX_NEW, generate, prompts, run_concurrently

KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
# The tiny model's KV block: 2 layers x 16 tokens x (K and V) x 2 heads x 16 dims, times the element size.
BLOCK_ELEMENTS = 2 * 16 * 2 * 2 * 16
MAX_PASSES = 10  # until a pass preempts by swapping (it depends on when the requests arrive)


def kv_prompts(vocab_size: int) -> list[list[int]]:
    """The reference prompts, then two that share three blocks (sent one after the other: the second
    reads the first's cached prefix)."""
    shared = prompts(vocab_size)[-1][:48]
    return [*prompts(vocab_size), [*shared, 5, 6], [*shared, 7]]


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def rounding_cache(kv_dtype: torch.dtype):
    """transformers' cache, rounding keys and values to kv_dtype as they are stored: attention then
    reads every key, this step's included, rounded, as ours reads them from the paged cache."""
    from transformers import DynamicCache

    limit = torch.finfo(kv_dtype).max

    class RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = (x.clamp(-limit, limit).to(kv_dtype).to(x.dtype) for x in (key_states, value_states))
            return super().update(k, v, layer_idx, *args, **kwargs)

    return RoundingCache()


def hf_greedy(model, all_prompts, kv_dtype: torch.dtype) -> dict[tuple[int, ...], list[int]]:
    out = {}
    for ids in all_prompts:
        gen = model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            cache=rounding_cache(kv_dtype),
        )
        out[tuple(ids)] = gen[0, len(ids) :].tolist()
    return out


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_kv_cache_dtype_serves_like_transformers_with_the_same_rounding(tiny_model, name):
    kv_dtype = KV_DTYPES[name]
    model = hf_model(tiny_model)
    all_prompts = kv_prompts(model.config.vocab_size)
    reference = hf_greedy(model, all_prompts, kv_dtype)
    if kv_dtype == torch.float8_e4m3fn:  # the comparison can tell the two fp8 formats apart
        assert hf_greedy(model, all_prompts, torch.float8_e5m2) != reference
    block_bytes = BLOCK_ELEMENTS * kv_dtype.itemsize
    flags = ("--dtype", "float32", "--kv-cache-dtype", name)
    # 16 device blocks (256 tokens) for 12 prompts of up to 200: preemptions; 64 host blocks: swapped.
    flags += ("--num-kv-blocks", "16", "--swap-space", repr(64.5 * block_bytes / 2**30))
    flags += ("--enable-prefix-caching", "--metrics-port", "0")

    def check(ids, tokens):
        assert tokens == reference[tuple(ids)], f"prompt of {len(ids)} tokens"

    with launch(tiny_model, *flags) as (target, info), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = dict(max_new_tokens=MAX_NEW, ignore_eos=True, sampling=GREEDY)
        for ids in all_prompts[-2:]:  # one after the other: the second reuses the first's prefix
            check(ids, generate(stub, token_ids=ids, **request)[0])
        metrics = scrape(info["metrics_ports"]["scheduler"])
        assert metrics["tpserve_prefix_cache_hits_total"] >= 48
        for _ in range(MAX_PASSES):
            results = run_concurrently(stub, [dict(token_ids=ids, **request) for ids in all_prompts])
            for ids, (tokens, _, reason, _) in zip(all_prompts, results, strict=True):
                check(ids, tokens)
                assert reason == pb.FINISH_REASON_LENGTH
            stats = stub.GetStats(pb.StatsRequest())
            assert stats.num_swapped == 0 and stats.num_running == stats.num_waiting == 0
            metrics = scrape(info["metrics_ports"]["scheduler"])
            if metrics.get("tpserve_preemptions_total{kind=swap}", 0.0) > 0:
                break
        else:
            pytest.fail(f"no pass of {MAX_PASSES} swapped a preempted sequence")
