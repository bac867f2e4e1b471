"""Decode graphs' device-independent parts (shard_worker/cuda_graphs.py): the buckets, when a step is
replayed, the static buffers' padding, and when graphs are refused. The padded replay through the model
itself runs under Triton's interpreter (test_triton_backend.py, case graph_buckets)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from shard_worker.attention import StepBatch, select_backend
from shard_worker.config import WorkerConfig
from shard_worker.cuda_graphs import (
    CudaGraphRunner,
    StaticBuffers,
    bucket_for,
    capture_sizes,
    graphs_unsupported,
)
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from tests.conftest import TINY

CPU = torch.device("cpu")


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(128) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
    assert capture_sizes(100)[-3:] == (80, 96, 100)
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(1024)[-2:] == (496, 512)  # larger decode batches run eagerly
    for max_num_seqs in range(1, 300):
        sizes = capture_sizes(max_num_seqs)
        assert list(sizes) == sorted(set(sizes)) and sizes[-1] == max_num_seqs
        for n in range(1, max_num_seqs + 1):
            bucket = bucket_for(n, sizes)
            # Padding is at most 2x below 8 sequences and at most 16 rows above.
            assert n <= bucket and (bucket - n < 16 or bucket < 2 * n), (n, bucket)
        assert bucket_for(max_num_seqs + 1, sizes) is None


def batch(query_lens, context_lens, tables, block_size=16) -> StepBatch:
    q, c = np.array(query_lens), np.array(context_lens)
    width = max(len(t) for t in tables)
    table = np.array([t + [0] * (width - len(t)) for t in tables])
    return StepBatch.build(np.arange(2, 2 + q.sum()), q, c, table, block_size, CPU)


def test_static_buffers_hold_the_step_then_padding_that_writes_only_the_reserved_block():
    cache = torch.zeros(2, 11, 16, 2, 8)  # 10 blocks for sequences, the 11th (id 10) reserved
    buffers = StaticBuffers(max_size=8, max_blocks=4, hidden_size=4, kv_cache=cache)
    big = batch([1] * 6, [5, 17, 33, 2, 40, 9], [[1], [2, 3], [4, 5, 6], [7], [8, 9, 0], [3]])
    buffers.fill(big, 8)
    small = batch([1, 1], [20, 3], [[6, 5], [4]])
    buffers.fill(small, 4)  # rows 2..3 held the big step's sequences: now padding
    assert buffers.input_ids[:4].tolist() == [2, 3, 0, 0]
    assert buffers.positions[:4].tolist() == [19, 2, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [5 * 16 + 3, 4 * 16 + 2, 160, 160]
    assert buffers.seq_lens[:4].tolist() == [20, 3, 1, 1]
    assert buffers.block_table[:2, :2].tolist() == [[6, 5], [4, 0]]
    assert (buffers.block_table[2:4] == 10).all()
    assert buffers.query_start_loc.tolist() == list(range(9))
    view = buffers.batch(4, max_seq_len=64)
    assert view.max_query_len == 1 and view.max_seq_len == 64 and view.num_seqs == 4
    assert view.block_table.data_ptr() == buffers.block_table.data_ptr()


def test_only_decode_steps_that_fit_are_replayed(monkeypatch):
    backend = select_backend("flex", CPU, torch.float32)
    monkeypatch.setattr(type(backend), "graph_capturable", True)  # bucket() reads no metadata
    cache = torch.zeros(2, 9, 16, 2, 8)
    runner = CudaGraphRunner(lambda *a: None, backend, [cache], 4, max_num_seqs=6, max_model_len=48)
    assert runner.sizes == (1, 2, 4, 6)
    assert runner.bucket(batch([1, 1, 1], [4, 20, 7], [[1], [2, 3], [4]])) == 4
    assert runner.bucket(batch([1, 2], [4, 20], [[1], [2, 3]])) is None  # a 2-token query
    assert runner.bucket(batch([1] * 7, [3] * 7, [[i] for i in range(7)])) is None  # past 6
    assert runner.bucket(batch([1], [60], [[1, 2, 3, 4]])) is None  # past max_model_len's 3 blocks
    assert runner.replay(batch([1], [4], [[1]])) is None  # nothing captured yet


def test_graphs_are_refused_for_backends_planned_on_the_host_and_old_nccl():
    flex = select_backend("flex", CPU, torch.float32)
    assert "flex attention backend plans each step on the host" in graphs_unsupported(flex, 1, (2, 21, 5))
    with pytest.raises(ValueError, match="cannot be captured"):
        CudaGraphRunner(lambda *a: None, flex, [torch.zeros(2, 3, 16, 1, 8)], 4, 4, 32)

    class Capturable:
        name, graph_capturable = "triton", True

    assert graphs_unsupported(Capturable(), 8, (2, 21, 5)) is None
    assert graphs_unsupported(Capturable(), 1, (0,)) is None  # one rank: NCCL is not involved
    assert "NCCL 2.8.4 cannot capture" in graphs_unsupported(Capturable(), 2, (2, 8, 4))


def test_a_runner_that_would_capture_needs_cuda_and_a_cache(monkeypatch):
    backend = select_backend("flex", CPU, torch.float32)
    monkeypatch.setattr(type(backend), "graph_capturable", True)
    with pytest.raises(ValueError, match="need a CUDA device"):
        CudaGraphRunner(lambda *a: None, backend, [torch.zeros(2, 3, 16, 1, 8)], 4, 4, 32, capture=True)
    with pytest.raises(RuntimeError, match="allocate it first"):
        CudaGraphRunner(lambda *a: None, backend, [], 4, 4, 32)


def test_a_runner_asked_for_graphs_with_flex_runs_eagerly_and_reserves_nothing(caplog):
    with caplog.at_level(logging.WARNING, "tpserve.shard_worker"):
        runner = ModelRunner(
            TINY, torch.float32, CPU, TensorParallel(), attention_backend="flex", cuda_graphs=True
        )
    assert not runner.cuda_graphs and runner.reserved_blocks == 0
    assert "no CUDA graphs: the flex attention backend" in caplog.text
    runner.allocate_kv_cache(5, 16)
    assert runner.kv_caches[0].shape[1] == 5 and runner.capture_cuda_graphs(8, 64) == 0.0
    assert runner.graphs is None


@pytest.mark.parametrize(
    "device, flags, graphs",
    [
        ("cuda", {}, True),
        ("cuda", {"enforce_eager": True}, False),
        ("cuda", {"cuda_graphs": False}, False),
        ("cpu", {}, False),  # ignored on CPU: there are no graphs to capture
    ],
)
def test_graphs_are_on_by_default_on_cuda_only(device, flags, graphs):
    assert WorkerConfig(model="m", device=device, **flags).use_cuda_graphs is graphs
