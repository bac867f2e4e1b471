"""The rules for what a machine must offer its shard workers, checked without a GPU."""

import pytest

from shard_worker.devices import (
    check_cuda_devices,
    check_dtype,
    cpu_flags,
    cuda_index,
    linear_dtype,
    model_dtype,
    usable_cores,
)


def test_no_cuda_device_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is available"):
        check_cuda_devices(1, 0)


@pytest.mark.parametrize("ranks, devices", [(1, 1), (2, 2), (2, 8), (1, 4)])
def test_ranks_that_fit_the_devices_pass(ranks, devices):
    check_cuda_devices(ranks, devices)


@pytest.mark.parametrize("ranks, devices", [(2, 1), (8, 4), (3, 2)])
def test_more_ranks_than_devices_is_refused_naming_both(ranks, devices):
    with pytest.raises(ValueError, match=f"--tp {ranks}: needs {ranks} CUDA devices .* has {devices}"):
        check_cuda_devices(ranks, devices)


def test_ranks_sharing_a_host_take_distinct_devices_and_a_lone_rank_takes_cuda0():
    assert [cuda_index(rank, 4) for rank in range(4)] == [0, 1, 2, 3]
    assert cuda_index(5, 1) == 0  # rank 5 of a group spread one rank per machine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_cpu_runs_every_dtype(dtype):
    check_dtype("cpu", dtype, native_bf16=False)


def test_bfloat16_needs_native_support_on_cuda():
    check_dtype("cuda", "bfloat16", native_bf16=True)
    with pytest.raises(ValueError, match="--dtype bfloat16: this GPU has no native bfloat16"):
        check_dtype("cuda", "bfloat16", native_bf16=False)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_other_dtypes_run_on_any_gpu(dtype):
    check_dtype("cuda", dtype, native_bf16=False)


BF16_CPU = frozenset({"avx512f", "avx512_bf16"})
AVX2_CPU = frozenset({"avx2", "fma"})


def test_linear_dtype_is_the_models_unless_bfloat16_is_asked_whatever_the_cpu():
    # No CPU makes a float32 model's linear layers bf16 on its own: bf16 is an explicit opt-in only.
    assert linear_dtype("dtype", "float32") is None
    assert linear_dtype("dtype", "float64") is None
    assert linear_dtype("bfloat16", "float32") == "bfloat16"
    assert linear_dtype("bfloat16", "bfloat16") is None  # already the model's dtype


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()


def test_dtype_auto_is_bf16_where_it_is_native_and_float32_on_other_cpus():
    avx512_bf16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
    amx = frozenset({"avx2", "amx_bf16", "amx_tile"})
    avx2 = frozenset({"avx2", "fma"})
    assert model_dtype("auto", "cpu", avx512_bf16, False) == (
        "bfloat16",
        "this CPU multiplies bfloat16 natively (avx512_bf16)",
    )
    assert model_dtype("auto", "cpu", amx, False)[0] == "bfloat16"
    assert model_dtype("auto", "cpu", avx2, False) == (
        "float32",
        "this CPU has no native bfloat16 products (no avx512_bf16 or amx_bf16)",
    )
    assert model_dtype("auto", "cuda", frozenset(), True)[0] == "bfloat16"
    assert model_dtype("auto", "cuda", frozenset(), False)[0] == "float16"
    # An explicit choice is exactly that dtype, whatever the machine.
    assert model_dtype("float32", "cpu", avx512_bf16, False) == ("float32", "asked for")
    assert model_dtype("float64", "cuda", frozenset(), True)[0] == "float64"


def test_launch_and_the_worker_default_to_dtype_auto_and_linear_layers_in_it():
    """`tpserve launch` (as vLLM's serve) and a worker started alone both default to --dtype auto, and
    launch hands it to every rank; --linear-dtype stays the model's unless asked."""
    from common import settings
    from common.cli import parse_args
    from shard_worker.config import WorkerConfig

    launch = parse_args(["launch", "--model", "m"])
    worker = parse_args(["shard-worker", "--model", "m"])
    assert launch.dtype == worker.dtype == "auto"
    assert launch.linear_dtype == worker.linear_dtype == "dtype"
    argv = settings.to_argv(launch, WorkerConfig)
    assert argv[argv.index("--dtype") + 1] == "auto"
    with pytest.raises(SystemExit):  # the old implicit choice is gone
        parse_args(["shard-worker", "--model", "m", "--linear-dtype", "auto"])


def cgroup(tmp_path, lines: str, files: dict[str, str]) -> dict[str, str]:
    (tmp_path / "self_cgroup").write_text(lines)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    return {"cgroup_root": str(tmp_path / "fs"), "cgroup_file": str(tmp_path / "self_cgroup")}


def test_a_containers_cpu_quota_caps_the_cores_rounded_up(tmp_path):
    # Kubernetes' limits.cpu: 2.5 on a 64-core node (cgroup v2): 3 threads, not 63.
    v2 = cgroup(tmp_path, "0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "250000 100000\n"})
    assert usable_cores(affinity=64, **v2) == 3
    assert usable_cores(affinity=2, **v2) == 2  # the CPUs it may run on bind first


def test_no_quota_leaves_the_cpus_it_may_run_on(tmp_path):
    unlimited = cgroup(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert usable_cores(affinity=6, **unlimited) == 6
    assert usable_cores(affinity=6, cgroup_root=str(tmp_path / "none"), cgroup_file="/nonexistent") == 6


def test_cgroup_v1_quota_and_its_unlimited_minus_one(tmp_path):
    where = "cpu,cpuacct/docker/abc"
    quota = {f"{where}/cpu.cfs_quota_us": "400000", f"{where}/cpu.cfs_period_us": "100000"}
    v1 = cgroup(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n", quota)
    assert usable_cores(affinity=32, **v1) == 4
    (tmp_path / "fs" / where / "cpu.cfs_quota_us").write_text("-1")
    assert usable_cores(affinity=32, **v1) == 32
