"""AWQ / GPTQ quantization_config handling (quant/int4_checkpoints.py): what is served, and the one-line
refusals (the worker turns them into exit 2 at start-up)."""

from __future__ import annotations

import pytest

from shard_worker.model.quant import select_quant_config
from shard_worker.model.quant.int4_checkpoints import AWQLinearMethod, GPTQLinearMethod
from shard_worker.model.quant.unquantized import UnquantizedLinearMethod

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def config(qc):
    return select_quant_config(qc, None, UnquantizedLinearMethod())


@pytest.mark.parametrize(
    "qc,line",
    [
        ({**AWQ, "bits": 8}, "awq: bits 8 is not supported (4 only)"),
        ({**AWQ, "version": "gemv_fast"}, "awq: version 'gemv_fast' is not supported (gemm only)"),
        ({**AWQ, "zero_point": False}, "awq: zero_point false is not supported"),
        ({**GPTQ, "bits": 3}, "gptq: bits 3 is not supported (4 only)"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "gptq: checkpoint_format 'marlin' is not supported"),
        ({**GPTQ, "dynamic": {"-:.*down": {}}}, "gptq: per-module `dynamic` overrides are not supported"),
        ({**GPTQ, "lm_head": True}, "gptq: a quantized lm_head is not supported"),
        ({**GPTQ, "group_size": 0}, "gptq: group_size 0 is not supported"),
    ],
)
def test_refusals_are_one_line(qc, line):
    with pytest.raises(ValueError) as e:
        config(qc)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_served_configs_choose_their_methods():
    from shard_worker.model.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear.__new__(ColumnParallelLinear)  # only its type is read
    awq = config({**AWQ, "modules_to_not_convert": ["mlp.down_proj"]})
    assert isinstance(
        awq.linear_method(layer, "model.layers.0.self_attn.qkv_proj", ["x.q_proj"]), AWQLinearMethod
    )
    kept = awq.linear_method(layer, "model.layers.0.mlp.down_proj", ["model.layers.0.mlp.down_proj"])
    assert isinstance(kept, UnquantizedLinearMethod)
    gptq = config({**GPTQ, "desc_act": True, "checkpoint_format": "gptq_v2"})
    method = gptq.linear_method(layer, "p", ["p"])
    assert isinstance(method, GPTQLinearMethod) and method.desc_act and method.format == "gptq_v2"
