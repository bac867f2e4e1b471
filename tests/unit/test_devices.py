"""The rules for what a machine must offer its shard workers, checked without a GPU."""

import pytest

from shard_worker.devices import check_cuda_devices, check_dtype, cuda_index


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
