"""The CPU kernels' build (shard_worker/cpu_ext.py, here through the attention kernel's
shard_worker/attention/cpu_kernel.py): once per machine and cache directory, reused by later starts,
refused in one line without a compiler; and the attention kernel's element types: every KV cache dtype
read exactly as kv_dtype.load reads it. Its attention itself is checked against a naive float64
attention with the other backends (test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from shard_worker import cpu_ext
from shard_worker.attention import cpu_kernel
from shard_worker.attention.kv_dtype import load


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cpu_kernel.EXT.forget()
    cpu_kernel.load.cache_clear()
    yield tmp_path
    cpu_kernel.EXT.forget()
    cpu_kernel.load.cache_clear()


def test_built_once_then_loaded(fresh_cache, monkeypatch):
    assert cpu_kernel.unavailable() is None
    built = list((fresh_cache / "tpserve_cpu_attention").glob("*.so"))
    assert len(built) == 1
    inode = built[0].stat().st_ino

    def no_build(*_):
        raise AssertionError("built again with a warm cache")

    cpu_kernel.EXT.forget()  # a new process, as far as the cache is concerned
    monkeypatch.setattr(cpu_kernel.EXT, "build", no_build)
    assert cpu_kernel.unavailable() is None
    assert [p.stat().st_ino for p in (fresh_cache / "tpserve_cpu_attention").glob("*.so")] == [inode]


def test_no_compiler_is_one_line(fresh_cache, monkeypatch):
    monkeypatch.setattr(cpu_ext, "compiler", lambda: None)
    reason = cpu_kernel.unavailable()
    assert reason == "no C++ compiler ($CXX, g++ or c++) to build the CPU attention kernel"


@pytest.mark.parametrize(
    "kv", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_one_key_reads_back_the_stored_value(kv):
    """With one visible key, attention returns its value: the kernel's conversion of every cache dtype
    equals kv_dtype.load's (fp8 through its own decode table), the scale applied to fp8 caches only."""
    gen = torch.Generator().manual_seed(0)
    cache = (torch.randn(2, 3, 16, 2, 64, generator=gen) * 4).to(kv)
    q = torch.randn(1, 4, 64, generator=gen)
    out = torch.empty_like(q)
    table = torch.tensor([[2]], dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int64)
    cpu_kernel.paged_attention(q, out, cache, one, one, one, table, 0.125, v_scale=0.5)
    want = load(cache[1, 2, 0], torch.float32, 0.5)  # [kv heads, d]
    torch.testing.assert_close(out[0], want.repeat_interleave(2, 0), rtol=0, atol=0)
