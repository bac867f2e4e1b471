"""Small random pooling checkpoints, built with transformers' own classes and save_pretrained, with
sentence-transformers' files (modules.json, 1_Pooling/config.json, sentence_bert_config.json) written as
sentence-transformers writes them, and a WordPiece tokenizer of a small vocabulary for the BERT ones; and
their reference outputs: transformers' forward in float32, pooled as sentence-transformers pools (computed
here, so the reference does not depend on our code).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = [
    "the", "a", "of", "and", "to", "in", "it", "on", "for", "with", "cat", "dog", "sat", "mat", "sun", "rain",
    "paris", "france", "capital", "city", "river", "what", "where", "who", "which", "is", "are", "was",
    "were", "big", "small", "red", "blue", "green", "fast", "slow", "tree", "house", "car", "road",
]  # fmt: skip
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=128,
    initializer_range=0.2,
)
# name -> (transformers class, pooling mode written to 1_Pooling (None: no sentence-transformers files),
# Normalize)
KINDS = {
    "bert-mean": ("BertModel", "mean", True),
    "bert-cls": ("BertModel", "cls", False),
    "bert-max": ("BertModel", "max", True),
    "bert-last": ("BertModel", "lasttoken", False),
    "xlmr-mean": ("XLMRobertaModel", "mean", True),
    "bert-cross": ("BertForSequenceClassification", None, False),
    "qwen3-last": ("Qwen3Model", "lasttoken", True),
    "llama-mean": ("LlamaModel", "mean", False),
}
VOCAB = len(SPECIAL) + len(WORDS) + 26


def _vocab(out: Path) -> Path:
    path = out / "vocab.txt"
    path.write_text("\n".join([*SPECIAL, *WORDS, *"abcdefghijklmnopqrstuvwxyz"]) + "\n")
    return path


def build(kind: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Writes the `kind` checkpoint (KINDS) to out_dir."""
    import transformers as t

    arch, mode, normalize = KINDS[kind]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if arch.startswith("Bert"):
        config = t.BertConfig(vocab_size=VOCAB, type_vocab_size=2, num_labels=1, **SMALL)
    elif arch.startswith("XLMRoberta"):
        config = t.XLMRobertaConfig(
            vocab_size=VOCAB, pad_token_id=1, **{**SMALL, "max_position_embeddings": 130}
        )
    else:
        decoder = dict(
            SMALL, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False
        )
        config = (t.Qwen3Config if arch.startswith("Qwen3") else t.LlamaConfig)(vocab_size=VOCAB, **decoder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch in ("Qwen3Model", "LlamaModel"):
            # A served decoder family: saved as its CausalLM (what the registry serves), pooled from the
            # final norm's output.
            causal = getattr(t, arch.replace("Model", "ForCausalLM"))
            model = causal(config)
        else:
            model = getattr(t, arch)(config)
        with torch.no_grad():  # LayerNorms randomised too, so a missing or misplaced one shows
            for name, param in model.named_parameters():
                if "LayerNorm" in name or "norm" in name:
                    param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out)
    if arch.startswith("Bert"):
        t.BertTokenizerFast(vocab_file=str(_vocab(out)), do_lower_case=True).save_pretrained(out)
    if mode is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
        modules.append(
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        )
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        (out / "modules.json").write_text(json.dumps(modules))
        (out / "1_Pooling").mkdir(exist_ok=True)
        flags = {
            f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
        }
        flags["pooling_mode_cls_token"] = mode == "cls"
        flags["pooling_mode_mean_tokens"] = mode == "mean"
        flags["pooling_mode_max_tokens"] = mode == "max"
        (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 100}))
    return out


@torch.no_grad()
def reference(model_dir: str | Path, prompts: list[list[int]], types: list[list[int]] | None = None):
    """transformers in float32, one prompt at a time (no padding), pooled as sentence-transformers pools
    (or, for a cross-encoder, its logits through sigmoid): [len(prompts), size]."""
    import transformers as t

    model_dir = Path(model_dir)
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    if arch.endswith("ForSequenceClassification"):
        model = getattr(t, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
        out = []
        for i, ids in enumerate(prompts):
            tt = torch.tensor([types[i]]) if types else None
            out.append(torch.sigmoid(model(torch.tensor([ids]), token_type_ids=tt).logits[0]))
        return torch.stack(out)
    model = t.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
    normalize = "Normalize" in (model_dir / "modules.json").read_text()
    out = []
    for ids in prompts:
        h = model(torch.tensor([ids])).last_hidden_state[0]
        if pooling.get("pooling_mode_cls_token"):
            v = h[0]
        elif pooling.get("pooling_mode_mean_tokens"):
            v = h.mean(0)
        elif pooling.get("pooling_mode_max_tokens"):
            v = h.max(0).values
        else:
            v = h[-1]
        out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return torch.stack(out)
