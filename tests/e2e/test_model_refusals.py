"""A model tpserve does not serve stops the worker at start-up with one line naming why, and exit 2:
an unknown architecture, and a config field that changes the maths and is not implemented (the full
list of refusals: tests/unit/test_model_config.py)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_startup_errors import only_line, tpserve
from tests.model_families import build_checkpoint


@pytest.mark.parametrize(
    "change, names",
    [
        ({"architectures": ["Gemma2ForCausalLM"]}, "architecture 'Gemma2ForCausalLM' is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ],
    ids=["architecture", "softcapping"],
)
def test_worker_refuses_naming_it(tmp_path, change, names):
    model = build_checkpoint("gemma3", tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | change))
    line = only_line(tpserve("shard-worker", "--model", str(model)), "shard-worker")
    assert names in line and str(model / "config.json") in line
