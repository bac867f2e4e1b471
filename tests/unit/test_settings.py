"""Settings declared once (common/settings.py): flags, validation and launch's pass-through come from the
config fields, so a default, a help text or a rule lives in one place."""

import argparse

import pytest

from common import settings
from common.cli import parse_args
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from scheduler.scheduler import SchedulingPolicy
from shard_worker.config import WorkerConfig


def parse(cls, argv):
    p = argparse.ArgumentParser()
    settings.add_arguments(p, cls)
    return p.parse_args(argv)


def test_defaults_come_from_the_fields_nested_policies_included():
    cfg = settings.from_args(SchedulerConfig, parse(SchedulerConfig, ["--worker", "h:1"]))
    assert cfg.policy == SchedulingPolicy() and cfg.policy.max_num_seqs == 128 and cfg.block_size == 16
    assert cfg.workers == ("h:1",)


def test_a_bad_value_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--max-num-seqs must be a number >= 1"):
        settings.from_args(
            SchedulerConfig, parse(SchedulerConfig, ["--worker", "h:1", "--max-num-seqs", "0"])
        )
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
        SchedulerConfig(workers=("h:1",), gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="--block-size must be a power of two"):
        SchedulerConfig(workers=("h:1",), block_size=24)
    with pytest.raises(ValueError, match="--max-num-seqs must be an int"):
        SchedulingPolicy(max_num_seqs=2.5)


def test_launch_takes_every_launch_flag_and_passes_each_to_its_process():
    argv = ["launch", "--model", "m", "--max-num-seqs", "7", "--bucket-edges", "10,20", "--dtype", "float64"]
    argv += ["--enable-prefix-caching", "--replica-stale-s", "1.5", "--swap-space", "2"]
    a = parse_args(argv)
    for cls in (SchedulerConfig, RouterConfig, WorkerConfig):
        child = settings.to_argv(a, cls)
        extra = {SchedulerConfig: ["--worker", "h:1"], RouterConfig: ["--scheduler", "h:2"]}.get(cls, [])
        rebuilt = settings.from_args(cls, parse(cls, child + extra))
        # Every launch flag arrives with launch's value.
        for f in settings.walk(cls):
            if f.setting.launch:
                assert getattr(parse(cls, child + extra), f.dest) == getattr(a, f.dest), f.flag
        if cls is SchedulerConfig:
            assert (
                rebuilt.policy.max_num_seqs == 7 and rebuilt.enable_prefix_caching and rebuilt.swap_space == 2
            )
        if cls is RouterConfig:
            assert rebuilt.admission.bucket_edges == (10, 20) and rebuilt.routing.stale_after_s == 1.5
        if cls is WorkerConfig:
            assert rebuilt.dtype == "float64" and rebuilt.model == "m"


def test_each_flag_is_declared_once_across_the_processes():
    """A launch flag two processes share (--model) must mean the same to both: launch passes one value."""
    seen = {}
    for cls in (SchedulerConfig, RouterConfig, WorkerConfig):
        for f in settings.walk(cls):
            if not f.setting.launch:
                continue
            if f.flag in seen:
                assert (seen[f.flag].default, seen[f.flag].kind) == (f.default, f.kind), f.flag
            seen.setdefault(f.flag, f)
