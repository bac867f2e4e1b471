"""Small random checkpoints of every family tpserve serves, built with transformers' own config and model
classes and saved with save_pretrained, so they are laid out exactly as real checkpoints of the family.

Each has a few layers, grouped-query attention, a sliding window (where the family has one) shorter than
the prompts below, and, for the MoE families, more experts than top-k. Weights are drawn with a larger
std than usual (and norms are randomised too, so a (1 + w) norm read as w would show): next-token
distributions are then peaked, and greedy decoding is not decided by near-ties. Embeddings are not tied
(tied ones are tested with Llama in tests/unit/test_checkpoints.py, and the real Gemma 3 ties them):
Gemma's scaled embedding would then dominate the logits and every model would repeat its last token.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

VOCAB = 256
LOGIT_STD = 4.0
WINDOW = 20  # not a multiple of block_size 16: a window edge falls inside a block
# Lengths past the window, one of them past two blocks of the window, and short ones.
PROMPT_LENS = (3, 17, 41, 70)
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.25,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _configs():
    import transformers as t

    moe = dict(num_experts_per_tok=2, router_jitter_noise=0.0)
    return {
        "llama": lambda: t.LlamaConfig(**SMALL, num_hidden_layers=2),
        "qwen2": lambda: t.Qwen2Config(
            **SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        "mistral": lambda: t.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=WINDOW),
        "qwen3": lambda: t.Qwen3Config(
            **SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        "gemma3": lambda: t.Gemma3TextConfig(
            **SMALL,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            # Not head_dim: the scale must follow it. Global layers with the larger models' linear scaling.
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            },
        ),
        "phi3": lambda: t.Phi3Config(**SMALL, num_hidden_layers=2, sliding_window=WINDOW),
        "mixtral": lambda: t.MixtralConfig(
            **SMALL, num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=8, **moe
        ),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(
            **SMALL,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=WINDOW,
            num_experts=8,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],  # one dense layer among the sparse ones
            **moe,
        ),
        # Sliding and full layers alternating, sinks, YaRN (stretched 4x past 128 positions), biased
        # router and experts. Expert features a multiple of 64: 32 a rank at --tp 2, one MXFP4 block.
        "gpt_oss": lambda: t.GptOssConfig(
            **{**SMALL, "intermediate_size": 64},
            num_hidden_layers=2,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=3.0,  # not the real 7: the clamp must bite on these small random weights
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
        ),
        # Multi-head latent attention over a latent of 32 + 8 (q through a rank-24 bottleneck; no head
        # shares keys: num_key_value_heads is num_attention_heads, as in the real model), interleaved
        # YaRN rope with mscale folded into the softmax scale; layer 0 dense, then 8 routed experts in 2
        # groups (top-1 group, top 2 in it, a correction bias) and a shared expert.
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **{k: v for k, v in SMALL.items() if k not in ("head_dim", "num_key_value_heads")},
            num_key_value_heads=4,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            n_shared_experts=1,
            moe_intermediate_size=32,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        # Three Gated DeltaNet layers and one gated full-attention layer (the released 3-of-4 pattern),
        # rotary over a quarter of each head, MoE with a gated shared expert in every layer.
        "qwen3_next": lambda: t.Qwen3NextConfig(
            **SMALL,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            partial_rotary_factor=0.25,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            norm_topk_prob=True,
            num_experts_per_tok=2,
        ),
        # Qwen3.5's text model: the same layer kinds, a dense MLP, the linear projections split, mrope
        # sections (one position for text: plain rope over half of each head).
        "qwen3_5": lambda: t.Qwen3_5TextConfig(
            **SMALL,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        ),
    }


FAMILIES = tuple(_configs())


def hf_config(family: str):
    return _configs()[family]()


def build_checkpoint(family: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Writes a random `family` checkpoint (config.json, generation_config.json, safetensors) to out_dir;
    overrides: config fields set otherwise (a variant's shape)."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    config = hf_config(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.2)
                if name.endswith("sinks"):  # gpt-oss: some heads' sinks take much of the weight
                    param.normal_(0.0, 2.0)
                if name.endswith(("router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias")):
                    param.normal_(0.0, 0.5)  # gpt-oss's, which transformers initialises to zero
            if family == "gpt_oss":
                _put_mxfp4_experts(model, config, seed)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: zeros would hide it
                    buffer.normal_(0.0, 0.3)
            # Logits of std LOGIT_STD whatever the hidden size (see shard_worker/model/builder.py).
            model.lm_head.weight.normal_(0.0, LOGIT_STD / config.hidden_size**0.5)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out)
    return out


def mxfp4_experts(config, seed: int) -> dict[str, torch.Tensor]:
    """gpt-oss's experts as its released checkpoints store them (MXFP4 blocks and scales, output rows
    first: gate_up_proj_blocks [E, 2I, H / 32, 16], down_proj_blocks [E, H, I / 32, 16]), random, with
    scales around 2 ** -4 so the decoded weights are about as large as the other layers'."""
    g = torch.Generator().manual_seed(seed + 7)
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            prefix = f"model.layers.{layer}.mlp.experts.{name}"
            tensors[f"{prefix}_blocks"] = torch.randint(
                0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g
            )
            tensors[f"{prefix}_scales"] = torch.randint(
                122, 126, (e, rows, cols // 32), dtype=torch.uint8, generator=g
            )
    return tensors


def _put_mxfp4_experts(model, config, seed: int) -> None:
    """The float checkpoint's experts are exactly the MXFP4 ones, decoded by transformers itself."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = mxfp4_experts(config, seed)
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = tensors[f"{name}_blocks"], tensors[f"{name}_scales"]
            param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))  # [E, in, out]


def write_mxfp4_checkpoint(float_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """The gpt-oss checkpoint of build_checkpoint(.., seed) as released: its experts in MXFP4 (the same
    weights), quantization_config quant_method mxfp4."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(float_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"
        ],
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text((src / "generation_config.json").read_text())
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (not iterable)
    tensors = {
        n: t for n, t in tensors.items() if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    from transformers import AutoConfig

    tensors |= mxfp4_experts(AutoConfig.from_pretrained(src), seed)
    save_file(tensors, out / "model.safetensors")
    return out


def prompts(seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(model_dir: str | Path, new_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """transformers' generate in float64, one prompt at a time (no padding), EOS ignored."""
    from transformers import AutoModelForCausalLM

    # The experts as transformers writes them out (a loop over the experts hit): its default grouped
    # matmul has no float64 kernel.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    )
    model.generation_config.eos_token_id = None
    out = {}
    for ids in prompts():
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        out[tuple(ids)] = gen[0, len(ids) :].tolist()
    return out
