"""GGUF files for tests, written with the `gguf` package's own writer and quantizers (as llama.cpp's
convert_hf_to_gguf.py lays a Llama out: q / k rows permuted, the BPE tokenizer in the metadata)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

# The tiny Llama's tensors by kind: 4-bit kept ones, Q8_0 (dequantized at load), plain.
TINY_TYPES = {
    "q_proj": "Q4_0",
    "k_proj": "Q4_1",
    "v_proj": "Q4_0",
    "o_proj": "Q4_1",
    "gate_proj": "Q4_0",
    "up_proj": "Q4_0",
    "down_proj": "Q8_0",
    "lm_head": "F16",
}


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of w [N, K] (K a multiple of 256), by a plain absmax rule (the gguf package has no
    Q6_K quantizer): [N, K / 256 * 210] uint8, read back by gguf's dequantize."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(n, k // 256, 16, 16)
    sub = np.abs(x).max(-1) / 31  # each 16-value sub-block's scale
    d = (sub.max(-1) / 127).astype(np.float16)  # the super-block's, fp16 as stored
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(sub / d.astype(np.float32)[..., None])), -128, 127)
        step = (d.astype(np.float32)[..., None] * sc)[..., None]
        q = np.clip(np.nan_to_num(np.round(x / step)), -32, 31).astype(np.int16) + 32
    u = q.reshape(n, k // 256, 2, 4, 32).astype(np.uint8)  # [half, j, l]: value l + 32 j of the half
    ql = (u[:, :, :, 0:2] & 15) | ((u[:, :, :, 2:4] & 15) << 4)  # [half, j % 2, l]
    qh = (u >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = np.bitwise_or.reduce(qh, axis=3)  # [half, l]
    blocks = np.concatenate(
        [
            ql.reshape(n, k // 256, 128),
            qh.reshape(n, k // 256, 64),
            sc.astype(np.int8).view(np.uint8),
            d[..., None].view(np.uint8),
        ],
        axis=-1,
    )
    return blocks.reshape(n, -1)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    model_dir: Path, out: Path, types: dict[str, str] = TINY_TYPES, reference_dir=None
) -> Path:
    """Writes the GGUF file; with reference_dir, also a float32 HF checkpoint of the weights the file
    holds (gguf's own dequantization of each tensor, in HF layout)."""
    import gguf
    from gguf.quants import dequantize, quantize

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    arch = gguf.MODEL_ARCH.LLAMA
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    layers, heads, kv = (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv_: kv_[1])
    special = {t["content"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in special else 1 for t, _ in vocab])
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)

    names = gguf.get_tensor_name_map(arch, layers)
    reference = {}
    for hf_name, w in load_file(model_dir / "model.safetensors").items():
        module, _, suffix = hf_name.rpartition(".")
        kind = module.rsplit(".", 1)[-1]
        name = names.get_name(module) + "." + suffix
        qtype = types.get(kind, "F32") if w.ndim == 2 else "F32"
        t = gguf.GGMLQuantizationType[qtype]
        if qtype in ("F32", "F16"):
            stored = w.astype(np.float32)
        elif qtype == "Q6_K":
            stored = quantize_q6_k(w)
        else:
            stored = quantize(w.astype(np.float32), t)
        stored = stored.astype(np.float16) if qtype == "F16" else stored
        # Quantization is per row, so the rows' order (q and k permuted for llama.cpp) commutes with it.
        reference[hf_name] = dequantize(stored, t).astype(np.float32).reshape(w.shape)
        if kind in ("q_proj", "k_proj"):
            stored = _permute(stored, heads if kind == "q_proj" else kv)
        writer.add_tensor(name, stored, raw_dtype=None if qtype in ("F32", "F16") else t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if reference_dir is not None:
        from safetensors.numpy import save_file

        reference_dir.mkdir(parents=True)
        save_file(reference, reference_dir / "model.safetensors", metadata={"format": "pt"})
        for extra in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (model_dir / extra).exists():
                shutil.copy(model_dir / extra, reference_dir / extra)
    return out


# Types of every kept int8 form, with blocks of 256 (Q6_K's super-block) along K: q, k, v mixed (one
# qkv_proj of group 16: the Q8_0 / Q5_0 parts' scales repeated), gate / up group 32, down Q6_K (its
# row-parallel halves 256 wide at --tp 2), the LM head Q8_0, the embedding Q8_0 (kept int8: its rows
# split between the ranks).
INT8_TYPES = {
    "embed_tokens": "Q8_0",
    "q_proj": "Q6_K",
    "k_proj": "Q8_0",
    "v_proj": "Q5_0",
    "o_proj": "Q8_0",
    "gate_proj": "Q8_0",
    "up_proj": "Q5_0",
    "down_proj": "Q6_K",
    "lm_head": "Q8_0",
}


def write_wide_llama(
    tiny_dir: Path, out: Path, hidden: int = 256, intermediate: int = 512, tie: bool = False
) -> Path:
    """A random Llama with the tiny model's tokenizer and every K a multiple of 256 (which Q6_K and the
    K-quants need), 2 layers: a directory write_tiny_gguf reads. tie: the LM head is the embedding."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = json.loads((tiny_dir / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=intermediate, head_dim=hidden // 4)
    config.pop("transformers_version", None)
    config["tie_word_embeddings"] = tie
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.float32)
        for p in model.parameters():  # tiny's scale: logits that separate, greedy tokens that are stable
            p.data.normal_(0, 0.1) if p.dim() > 1 else p.data.fill_(1.0)
    model.save_pretrained(out)
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / extra, out / extra)
    return out
