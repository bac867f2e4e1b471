"""Where a worker keeps its LoRA adapters: the host cache of --max-cpu-loras (least recently used out),
the --max-loras device slots, and the worker's adapters loaded, evicted, read again and unloaded while
serving, with each step's rows reading the right adapter's weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shard_worker.config import WorkerConfig
from shard_worker.model.lora import LoRAAdapters, check_lora
from shard_worker.model.lora.cache import DeviceSlots, HostCache
from tests.lora_adapters import ATTENTION, make_adapter
from tests.unit.greedy import new_runner


def test_host_cache_evicts_the_least_recently_used_never_one_the_step_keeps():
    cache = HostCache(2)
    assert cache.put("a", 1) == [] and cache.put("b", 2) == []
    assert cache.get("a") == 1  # a is now the most recent
    assert cache.put("c", 3) == ["b"] and cache.names() == ["a", "c"]
    assert cache.get("b") is None
    # The step needs a and c: d comes in beyond the capacity rather than evict either.
    assert cache.put("d", 4, keep=["a", "c"]) == [] and len(cache) == 3
    assert cache.put("e", 5) == ["a", "c"] and cache.names() == ["d", "e"]
    assert cache.put("d", 44) == [] and cache.get("d") == 44 and cache.names() == ["e", "d"]
    with pytest.raises(ValueError, match="max-cpu-loras"):
        HostCache(0)


def test_device_slots_reuse_free_slots_then_the_least_recently_used_unwanted_one():
    slots = DeviceSlots(2)
    assert slots.assign(["a"]) == ({"a": 0}, [(0, "a")])
    assert slots.assign(["a", "b"]) == ({"a": 0, "b": 1}, [(1, "b")])  # a stays where it is
    assert slots.assign(["b"]) == ({"b": 1}, [])
    assert slots.assign(["c", "b"]) == ({"c": 0, "b": 1}, [(0, "c")])  # a was the least recent
    assert slots.drop("c") == 0 and slots.slot("c") is None
    assert slots.assign(["d"]) == ({"d": 0}, [(0, "d")])  # the freed slot
    with pytest.raises(ValueError, match="above --max-loras 2"):
        slots.assign(["x", "y", "z"])


def test_max_cpu_loras_defaults_to_max_loras_and_may_not_be_below_it(tiny_model):
    base = dict(model=str(tiny_model), enable_lora=True, max_loras=3)
    assert WorkerConfig(**base).max_cpu_loras == 0  # 0: --max-loras, as vLLM's unset
    with pytest.raises(ValueError, match="--max-cpu-loras 2 must be at least --max-loras 3"):
        WorkerConfig(**base, max_cpu_loras=2)


@pytest.fixture(scope="module")
def two_adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lru")
    return (
        make_adapter(tiny_model, root / "a", seed=5, rank=4),
        make_adapter(tiny_model, root / "b", seed=6, rank=8, targets=ATTENTION),
    )


def _slot_weights(lora: LoRAAdapters, slot: int) -> dict:
    return {n: (m.lora_a[slot].clone(), m.lora_b[slot].clone()) for n, m in lora.methods.items()}


def _expected(lora: LoRAAdapters, weights: dict) -> dict:
    """The device slot an adapter's host weights fill: zeros in the layers it leaves alone."""
    return {
        n: weights.get(n, (torch.zeros_like(m.lora_a[0]), torch.zeros_like(m.lora_b[0])))
        for n, m in lora.methods.items()
    }


def test_an_evicted_adapter_is_read_again_and_each_step_reads_its_own_weights(tiny_model, two_adapters):
    a, b = two_adapters
    runner = new_runner(tiny_model, torch.float32)
    # One device slot, one adapter on the host: every switch evicts the other and reads it again.
    lora = LoRAAdapters(runner.model, [f"a={a}"], 8, torch.float32, "cpu", max_loras=1, max_cpu_loras=1)
    fresh = {"a": lora.read("a", str(a)), "b": lora.read("b", str(b))}
    lora.install("b", str(b), fresh["b"])  # loaded while serving: a leaves the host, stays served
    assert lora.host.names() == ["b"] and set(lora.paths) == {"a", "b"}
    lens = np.array([3, 1])
    for name in ("a", "b", "a"):
        batch = lora.batch(["", name], lens)
        assert batch.order.tolist() == [3] and batch.counts == [1]  # the second sequence's row, slot 0
        assert lora.host.names() == [name]
        want = _expected(lora, fresh[name])
        for layer, (got_a, got_b) in _slot_weights(lora, 0).items():
            assert torch.equal(got_a, want[layer][0]) and torch.equal(got_b, want[layer][1]), layer
        occupied = {n for n, m in lora.methods.items() if m.occupied[0]}
        assert occupied == set(fresh[name])  # b leaves the MLP alone: those layers skip the product
    assert lora.batch(["", ""], lens) is None  # base-model rows only: no adapter product at all
    assert lora.remove("b") and not lora.remove("b")
    with pytest.raises(KeyError, match="'b'"):
        check_lora(lora, "b")
