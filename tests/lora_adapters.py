"""Random PEFT LoRA adapters for a checkpoint, written by peft itself, and transformers + peft's greedy
tokens with one applied: the independent reference for served adapters."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.reference import MAX_NEW, prompts

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir, out_dir, seed: int, rank: int = 8, alpha: float = 16, targets=ALL, rslora: bool = False
) -> Path:
    """A LoRA adapter of model_dir saved by peft in out_dir, B drawn at random (peft starts it at zero,
    which would make every adapter the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                param.normal_(0, 0.3 if "lora_B" in name else 0.2)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def copy_adapter(adapter, dest, config=None, tensors=None) -> Path:
    """A copy of an adapter directory, its config updated with `config`, its tensors passed through
    tensors(dict) when given: adapters that must be refused."""
    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    dest.mkdir()
    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps(cfg | (config or {})))
    weights = load_file(Path(adapter) / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dest / "adapter_model.safetensors")
    return dest


def narrower(weights: dict) -> dict:
    """An adapter's tensors as if its model had 32 hidden features (q_proj's A cut): another base."""
    return {k: v[:, :32].contiguous() if "q_proj.lora_A" in k else v for k, v in weights.items()}


def hf_lora_greedy(model_dir, adapter_dir, lens=None) -> dict[tuple[int, ...], list[int]]:
    """tests/reference.py's prompts (those of these lengths; None: all), greedy in float64 through
    transformers with the adapter applied by peft (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).to(torch.float64)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = {}
    for ids in prompts(model.config.vocab_size):
        if lens is not None and len(ids) not in lens:
            continue
        gen = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW
        )
        out[tuple(ids)] = gen[0, len(ids) :].tolist()
    return out
