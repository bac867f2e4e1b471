"""Multi-LoRA pieces on their own: the step's batched adapter product against a loop over rows, shards
that add up to the whole at --tp 2, adapters refused at load, the prefix cache keyed by adapter and the
scheduler's --max-loras (plain Python)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.pb.tpserve.internal.v1 import scheduler_pb2
from router.in_flight import InFlight
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence
from shard_worker.model.layers.linear import QKVParallelLinear, RowParallelLinear
from shard_worker.model.lora import LoRAAdapters, check_lora
from shard_worker.model.lora.adapters import AdapterUnreadable
from shard_worker.model.lora.layers import LoRABatch, _grouped_ok, lora_delta, stack_layer
from shard_worker.model.quant.unquantized import UnquantizedLinearMethod
from shard_worker.parallel import TensorParallel
from tests.lora_adapters import copy_adapter, make_adapter, narrower
from tests.unit.fakes import one_each
from tests.unit.greedy import new_runner


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("even", [False, True], ids=["uneven", "even"])
def test_batched_product_equals_a_loop_over_rows(dtype, even):
    torch.manual_seed(0)
    slots, k, d_in, d_out = 3, 16, 64, 48
    a, b = torch.randn(slots, k, d_in, dtype=dtype), torch.randn(slots, d_out, k, dtype=dtype)
    seq_slots = [2, -1, 0, 2, 1, -1]
    query_lens = [1, 3, 1, 1, 2, 2] if even else [5, 3, 1, 1, 20, 2]
    x = torch.randn(sum(query_lens), d_in, dtype=dtype)
    batch = LoRABatch.build(seq_slots, query_lens, slots, "cpu")
    # Even shares: one padded bmm per side. Else float32 takes F.grouped_mm; float64 (which torch's
    # grouped_mm does not take) the loop over adapters.
    assert (batch.padded is not None) == even
    assert _grouped_ok(x, a, b) == (dtype == torch.float32)
    got = torch.zeros(x.shape[0], d_out, dtype=dtype).index_add(0, batch.order, lora_delta(x, a, b, batch))
    row_slots = np.repeat(seq_slots, query_lens)
    for row, slot in enumerate(row_slots):
        want = torch.zeros(d_out, dtype=dtype) if slot < 0 else b[slot] @ (a[slot] @ x[row])
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)
    assert LoRABatch.build([-1, -1], [3, 1], slots, "cpu") is None  # base-model rows only: no product


def test_tp2_shards_add_up_to_the_whole_adapter():
    """Column-parallel q/k/v keep A whole and split B's rows per part; row-parallel o splits A's columns:
    concatenated (q/k/v) and summed (o) shards equal the unsharded delta."""
    torch.manual_seed(1)
    r, hidden, head_dim = 4, 32, 8
    qkv = {p: (torch.randn(r, hidden), torch.randn(n, r)) for p, n in enumerate([32, 16, 16])}
    o = {0: (torch.randn(r, 32), torch.randn(hidden, r))}
    x, xo = torch.randn(5, hidden), torch.randn(5, 32)
    batch = LoRABatch.build([0], [5], 1, "cpu")

    def delta(layer, pairs, inputs):
        a, b = stack_layer(layer, [pairs], 8, torch.float32, "cpu")
        return lora_delta(inputs, a, b, batch)

    whole = [
        QKVParallelLinear(hidden, head_dim, 4, 2, TensorParallel()),
        RowParallelLinear(32, hidden, TensorParallel()),
    ]
    full_qkv, full_o = delta(whole[0], qkv, x), delta(whole[1], o, xo)
    torch.testing.assert_close(full_qkv, torch.cat([x @ a.T @ b.T for a, b in qkv.values()], 1))
    shards_qkv, sum_o = [], 0
    for rank in range(2):
        tp = TensorParallel(rank=rank, world_size=2)
        shards_qkv.append(delta(QKVParallelLinear(hidden, head_dim, 4, 2, tp), qkv, x))
        sum_o = sum_o + delta(RowParallelLinear(32, hidden, tp), o, xo[:, rank * 16 : (rank + 1) * 16])
    # Rank r holds [q shard r; k shard r; v shard r].
    parts = [s.split([16, 8, 8], 1) for s in shards_qkv]
    joined = torch.cat([torch.cat([p[i] for p in parts], 1) for i in range(3)], 1)
    torch.testing.assert_close(joined, full_qkv)
    torch.testing.assert_close(sum_o, full_o)


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return make_adapter(tiny_model, tmp_path_factory.mktemp("lora") / "a", seed=3, rank=8)


def test_refusals_are_one_line_naming_the_adapter(tiny_model, adapter, tmp_path):
    runner = new_runner(tiny_model, torch.float32)

    def refused(path, max_rank=16):
        with pytest.raises(ValueError) as e:
            LoRAAdapters(runner.model, [f"bad={path}"], max_rank, torch.float32, "cpu")
        assert "\n" not in str(e.value) and "'bad'" in str(e.value)
        return str(e.value)

    assert "rank 8 is above --max-lora-rank 4" in refused(adapter, max_rank=4)

    assert "another base model" in refused(copy_adapter(adapter, tmp_path / "shape", tensors=narrower))

    def embedding(weights):
        return {k.replace("self_attn.q_proj", "embed_tokens"): v for k, v in weights.items()}

    assert "target module 'embed_tokens' is not served" in refused(
        copy_adapter(adapter, tmp_path / "emb", tensors=embedding)
    )
    dora = copy_adapter(adapter, tmp_path / "dora", config={"use_dora": True})
    assert "DoRA is not served" in refused(dora)
    # Files that do not read (gone since the first start) do not stop the rank: the adapter is served
    # unreadable, a prefetch of it is NOT_FOUND naming it, and a step on it reports it and runs base rows.
    gone = LoRAAdapters(runner.model, [f"gone={tmp_path}"], 16, torch.float32, "cpu")
    gone.check("gone")
    with pytest.raises(AdapterUnreadable, match="'gone'.*expected adapter_config.json"):
        gone.fetch("gone")
    assert gone.batch(["gone", ""], np.array([3, 2])) is None
    [(name, why)] = gone.take_errors()
    assert name == "gone" and "expected adapter_config.json" in why and not gone.take_errors()
    # A served one: unknown names are a KeyError naming them ("" is the base model).
    lora = LoRAAdapters(runner.model, [f"good={adapter}"], 16, torch.float32, "cpu")
    check_lora(lora, "good")
    check_lora(lora, "")
    with pytest.raises(KeyError, match="'other'"):
        check_lora(lora, "other")
    wrapped = [m for m in runner.model.modules() if hasattr(getattr(m, "quant_method", None), "lora_a")]
    assert len(wrapped) == 2 * 4 and isinstance(wrapped[0].quant_method.base, UnquantizedLinearMethod)


def _seq(i, tokens, lora=""):
    return Sequence(i, f"r{i}", list(tokens), len(tokens), 4, lora_name=lora)


def test_two_adapters_never_share_prefix_blocks():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    first = _seq(0, range(100, 113), "a")
    bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.register_full_blocks(first)
    assert bm.match_prefix(_seq(1, range(100, 113), "a")) == 12  # same adapter: its three full blocks
    assert bm.match_prefix(_seq(2, range(100, 113), "b")) == 0
    assert bm.match_prefix(_seq(3, range(100, 113))) == 0  # nor the base model


def test_the_routers_block_hashes_are_the_schedulers_under_the_same_adapter():
    # Cache-aware routing is exact only if the router hashes a request's prompt as its replica's prefix
    # cache registers it: with the request's adapter as every block's extra key.
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    first = _seq(0, range(100, 113), "a")
    bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.register_full_blocks(first)
    cached = set(bm.cached_hashes())

    def routed(lora):
        add = scheduler_pb2.AddRequest(request_id="x", prompt_token_ids=range(100, 113), lora_name=lora)
        return InFlight(add, 0.0, None).block_hashes(4)

    assert len(cached) == 3 and set(routed("a")) == cached
    assert not cached & set(routed("b")) and not cached & set(routed(""))


def test_at_most_max_loras_adapters_per_step_and_none_starves():
    sched = Scheduler(
        SchedulingPolicy(max_loras=2, max_model_len=256), BlockManager(256, 16), eos_token_ids=[2]
    )
    for i in range(12):  # adapters a, b, c, d round robin, and base-model requests between
        sched.add(_seq(i, [10 + i] * 5, lora="abcd"[i % 4] if i % 3 else ""))
    finished, steps, later = set(), 0, 100
    while sched.has_unfinished:
        out = sched.schedule()
        adapters = {s.seq.lora_name for s in out.scheduled} - {""}
        assert len(adapters) <= 2
        updates = sched.update(out, one_each([5] * sum(1 for s in out.scheduled if s.num_samples)))
        finished |= {u.seq.request_id for u in updates if u.seq.is_finished}
        steps += 1
        if steps < 30:  # requests on the running adapters keep coming: the waiting ones still get in
            sched.add(_seq(later, [7] * 5, lora=sorted(adapters)[0] if adapters else "a"))
            later += 1
        assert steps < 500, "a request starved"
    assert {f"r{i}" for i in range(12)} <= finished


def test_a_prefetched_adapter_is_never_read_on_the_step_path(tiny_model, adapter, tmp_path):
    """Before, a step read an adapter evicted from the host from disk, on every rank. fetch (any
    thread) and keep (between steps) put it back before the step that needs it."""
    runner = new_runner(tiny_model, torch.float32)
    other = copy_adapter(adapter, tmp_path / "b")
    lora = LoRAAdapters(runner.model, [f"a={adapter}", f"b={other}"], 16, torch.float32, "cpu", 1, 1)
    lens = np.array([2])
    assert lora.batch(["b"], lens) is not None and "a" not in lora.host  # one on the host: b evicted a
    fetched = lora.fetch("a")
    assert fetched is not None and lora.fetch("b") is None  # b is on the host: nothing to read

    def no_reading(name, path):
        raise AssertionError(f"{name} read on the step path")

    lora.keep("a", fetched)
    lora.read = no_reading
    assert lora.batch(["a"], lens) is not None and not lora.take_errors()
