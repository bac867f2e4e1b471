"""config.json's architectures[0] -> the model class that serves it. The runner knows only this and the
interface in shard_worker/model/base.py; adding a family is its file, its line here, and its test.

Classes are named as "module:Class" and imported on first use, so a worker imports only its own family.
"""

from __future__ import annotations

import importlib

ARCHITECTURES = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama:Qwen2ForCausalLM",
    "MistralForCausalLM": "mistral:MistralForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "gemma3:Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "gpt_oss:GptOssForCausalLM",
    # DeepSeek-V3, DeepSeek-R1 and Kimi K2.
    "DeepseekV3ForCausalLM": "deepseek_v3:DeepseekV3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3NextForCausalLM": "qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "qwen3_5:Qwen3_5ForConditionalGeneration",  # text only
    # Encoders, served for pooling only (common/pooling.py).
    "BertModel": "bert:BertModel",
    "BertForSequenceClassification": "bert:BertForSequenceClassification",
    "XLMRobertaModel": "bert:XLMRobertaModel",
    "XLMRobertaForSequenceClassification": "bert:XLMRobertaForSequenceClassification",
    # Decoders with a classification head over the last token (shard_worker/model/classifier.py).
    "LlamaForSequenceClassification": "llama:LlamaForSequenceClassification",
    "Qwen3ForSequenceClassification": "qwen3:Qwen3ForSequenceClassification",
}


def model_class(architecture: str):
    """The CausalLM subclass for an architecture; ValueError naming it (and what is served) otherwise."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    module, name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(f"shard_worker.model.{module}"), name)
