"""YaRN as transformers computes it, for gpt-oss's and DeepSeek-V3's configs: the inverse frequencies
must be bit-equal (float32) and the attention factor equal, or long-context positions drift."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

from shard_worker.model.layers.rotary import rotary_spec, yarn_rope, yarn_softmax_scale

GPT_OSS_ROPE = {  # openai/gpt-oss-20b's config.json
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEEPSEEK_V3_ROPE = {  # deepseek-ai/DeepSeek-V3's config.json
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}


def gpt_oss(rope: dict) -> GptOssConfig:
    return GptOssConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=dict(rope))


def deepseek(rope: dict) -> DeepseekV3Config:
    return DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(rope))


CASES = {
    "gpt-oss": (gpt_oss, GPT_OSS_ROPE, 64),
    "gpt-oss truncated": (gpt_oss, {**GPT_OSS_ROPE, "truncate": True}, 64),
    "deepseek-v3": (deepseek, DEEPSEEK_V3_ROPE, 64),
    # mscale without mscale_all_dim: the plain factor decides the attention factor
    "deepseek-v3 mscale only": (deepseek, {**DEEPSEEK_V3_ROPE, "mscale_all_dim": 0, "mscale": 0.707}, 64),
    "mscales differ": (deepseek, {**DEEPSEEK_V3_ROPE, "mscale": 0.707, "mscale_all_dim": 1.0}, 64),
    "explicit attention_factor, default betas": (
        gpt_oss,
        {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "attention_factor": 0.5,
            "original_max_position_embeddings": 2048,
        },
        64,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_yarn_matches_transformers_rope_init(case):
    make, rope, rotary_dim = CASES[case]
    hf = make(rope)
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    inv_freq, factor = yarn_rope(hf.rope_parameters, rotary_dim, hf.max_position_embeddings)
    assert inv_freq.dtype == torch.float32 and torch.equal(inv_freq, want_inv_freq.float())
    assert factor == pytest.approx(want_factor, rel=1e-12)
    spec = rotary_spec(hf, rotary_dim, hf.rope_parameters)
    assert spec.inv_freq == tuple(want_inv_freq.float().tolist()) and spec.attention_scaling == factor


def test_yarn_without_factor_stretches_by_the_position_ratio():
    # DeepSeek's convention when factor is absent: max_position_embeddings / original positions.
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 4096}
    inv_freq, factor = yarn_rope(rope, 64, 4096 * 8)
    want, _ = yarn_rope({**rope, "factor": 8.0}, 64, 1)
    assert torch.equal(inv_freq, want) and factor == pytest.approx(
        0.1 * torch.log(torch.tensor(8.0)).item() + 1
    )


@pytest.mark.parametrize(
    "rope", [DEEPSEEK_V3_ROPE, {**DEEPSEEK_V3_ROPE, "mscale_all_dim": 0.5}, GPT_OSS_ROPE]
)
def test_yarn_softmax_scale_matches_transformers(rope):
    scale = 192**-0.5
    assert yarn_softmax_scale(rope, scale) == pytest.approx(yarn_apply_mscale(rope, scale), rel=1e-12)
