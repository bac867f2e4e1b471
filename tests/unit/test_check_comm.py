"""tpserve check-comm's arithmetic (nccl-tests' definitions) and its Kubernetes Job, offline."""

from __future__ import annotations

import argparse

import kubernetes_validate
import yaml

from common.cli import parse_args
from shard_worker.comm_check import Sample, bus_bandwidth, sizes, verdict
from tests.conftest import ROOT


def test_bus_bandwidth_is_nccl_tests_all_reduce_factor():
    assert bus_bandwidth(10.0, 2) == 10.0  # 2 (n - 1) / n = 1
    assert bus_bandwidth(10.0, 8) == 17.5  # 2 * 7 / 8


def test_sizes_double_from_one_sequence_and_include_a_decode_step():
    got = sizes(hidden_size=4096, max_num_seqs=100, itemsize=2, max_bytes=4 * 2**20)
    assert got[0] == 8192 and got[-1] == 4 * 2**20 and 100 * 4096 * 2 in got
    assert all(b > a for a, b in zip(got, got[1:], strict=False))


def test_verdict_counts_two_all_reduces_per_layer_of_the_step_size():
    step_bytes = 128 * 4096 * 2
    samples = [
        Sample(8192, 10e-6, 0.8, 0.8),
        Sample(step_bytes, 40e-6, 26.0, 45.5),
        Sample(64 << 20, 1e-3, 67.0, 117.4),
    ]
    v = verdict(samples, step_bytes, num_layers=32, step_limit_ms=5.0, link_limit_gbit=200.0)
    assert abs(v.step_allreduce_ms - 2 * 32 * 0.040) < 1e-9 and v.step_ok
    assert abs(v.link_gbit - 117.4 * 8) < 1e-9 and v.link_ok
    slow = verdict(samples, step_bytes, num_layers=32, step_limit_ms=2.0, link_limit_gbit=1000.0)
    assert not slow.step_ok and not slow.link_ok


def test_the_job_manifest_is_valid_and_its_command_parses():
    (job,) = [d for d in yaml.safe_load_all((ROOT / "k8s" / "jobs" / "check-comm.yaml").read_text()) if d]
    kubernetes_validate.validate(job, kubernetes_validate.utils.latest_version(), strict=True)
    container = job["spec"]["template"]["spec"]["containers"][0]
    a = parse_args(container["args"])
    assert isinstance(a, argparse.Namespace) and a.command == "check-comm"
    assert a.world_size == container["resources"]["limits"]["nvidia.com/gpu"] and a.device == "cuda"
