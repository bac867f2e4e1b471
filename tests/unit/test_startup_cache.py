"""Inductor's instruction-set load probes, answered once per compile cache (shard_worker/startup.py): a
start that finds this machine's loads noted as passing beside the kernels runs none; a failed load, or
another machine's note, leaves the probes to run. The child process a real probe starts is faked here."""

from __future__ import annotations

import json

import pytest
from torch._inductor import cpu_vec_isa

from shard_worker import startup
from shard_worker.startup import VEC_ISA_FILE, install_vec_isa_probe, remember_vec_isa


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A fresh process's probe state over a compile cache in tmp_path, with a fake child load whose
    answer the test sets; yields the list of loads the fake was asked for."""
    assert hasattr(cpu_vec_isa.VecISA, "_probe_load"), (
        "torch's probe moved: install_vec_isa_probe wraps nothing"
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    loads, answer = [], {"passes": True}

    def fake_load(isa, output_path):
        loads.append(output_path)
        return answer["passes"]

    def new_process():
        monkeypatch.setattr(startup, "_probe", {"installed": False, "known": False, "ran": 0, "failed": 0})
        monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", fake_load)
        install_vec_isa_probe()

    def load() -> bool:
        return cpu_vec_isa.VecISA._probe_load(cpu_vec_isa.VecAVX2(), "probe.so")

    yield new_process, load, loads, answer


def test_a_start_after_passing_loads_runs_no_probe(probe, tmp_path):
    new_process, load, loads, _ = probe
    new_process()
    assert load() and len(loads) == 1  # a new cache: the child load runs
    remember_vec_isa(tmp_path)
    assert (tmp_path / VEC_ISA_FILE).is_file()

    new_process()
    assert load() and len(loads) == 1, "the known load was probed again"


def test_a_failed_load_or_another_machine_probes_again(probe, tmp_path):
    new_process, load, loads, answer = probe
    new_process()
    answer["passes"] = False
    assert not load()
    remember_vec_isa(tmp_path)
    assert not (tmp_path / VEC_ISA_FILE).exists()

    answer["passes"] = True
    new_process()
    load()
    remember_vec_isa(tmp_path)
    note = json.loads((tmp_path / VEC_ISA_FILE).read_text())
    (tmp_path / VEC_ISA_FILE).write_text(json.dumps({**note, "torch": "2.0.0"}))  # another torch's
    new_process()
    load()
    assert len(loads) == 3
