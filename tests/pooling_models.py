"""Small random pooling checkpoints, built with transformers' own classes and save_pretrained, with
sentence-transformers' files (modules.json, 1_Pooling/config.json, 2_Dense's config and weights,
sentence_bert_config.json) written as sentence-transformers writes them, and a WordPiece tokenizer of a
small vocabulary for the BERT ones; and their reference outputs: transformers' forward in float32, pooled
as sentence-transformers pools (computed here, so the reference does not depend on our code).
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
    "bert-classify": ("BertForSequenceClassification", None, False),  # three labels (LABELS)
    "qwen3-last": ("Qwen3Model", "lasttoken", True),
    "llama-mean": ("LlamaModel", "mean", False),
    "qwen3-rerank": ("Qwen3ForSequenceClassification", None, False),  # Qwen3-Reranker's seq-cls shape
    "bert-dense": ("BertModel", "mean", True),  # with a Dense module (DENSE) between Pooling and Normalize
}
# Classifiers' label names (config.json's id2label); one label (a cross-encoder's score) where not named.
LABELS = {"bert-cross": ["relevant"], "bert-classify": ["negative", "neutral", "positive"]}
# Kinds with a sentence-transformers Dense module: its out_features and activation_function.
DENSE = {"bert-dense": (24, "torch.nn.modules.activation.Tanh")}
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
        names = LABELS.get(kind, ["LABEL_0"])
        id2label = dict(enumerate(names))
        label2id = {v: k for k, v in id2label.items()}
        labelled = dict(id2label=id2label, label2id=label2id)
        config = t.BertConfig(vocab_size=VOCAB, type_vocab_size=2, **labelled, **SMALL)
    elif arch.startswith("XLMRoberta"):
        config = t.XLMRobertaConfig(
            vocab_size=VOCAB, pad_token_id=1, **{**SMALL, "max_position_embeddings": 130}
        )
    else:
        decoder = dict(
            SMALL, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False
        )
        if arch.endswith("ForSequenceClassification"):  # one label: the reranker's yes-minus-no logit
            decoder.update(num_labels=1, pad_token_id=0)
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
        if kind in DENSE:
            _dense(out / "2_Dense", config.hidden_size, *DENSE[kind], seed)
            dense = {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}
            modules.append({"idx": len(modules), "name": str(len(modules)), **dense})
        if normalize:
            modules.append(
                {
                    "idx": len(modules),
                    "name": str(len(modules)),
                    "path": f"{len(modules)}_Normalize",
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


def _dense(folder: Path, in_features: int, out_features: int, activation: str, seed: int) -> None:
    """A Dense module's folder as sentence-transformers saves it: config.json and model.safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    config = {"in_features": in_features, "out_features": out_features, "bias": True}
    (folder / "config.json").write_text(json.dumps({**config, "activation_function": activation}))
    gen = torch.Generator().manual_seed(seed + 1)
    weights = {
        "linear.weight": torch.randn(out_features, in_features, generator=gen) * in_features**-0.5,
        "linear.bias": torch.randn(out_features, generator=gen) * 0.1,
    }
    save_file(weights, str(folder / "model.safetensors"))


def _apply_dense(model_dir: Path, v: torch.Tensor) -> torch.Tensor:
    """Each Dense module of modules.json on v, as sentence-transformers' Dense computes it."""
    from safetensors.torch import load_file

    for module in json.loads((model_dir / "modules.json").read_text()):
        if module["type"].endswith(".Dense"):
            folder = model_dir / module["path"]
            w = load_file(str(folder / "model.safetensors"))
            config = json.loads((folder / "config.json").read_text())
            act = getattr(torch.nn, config["activation_function"].rsplit(".", 1)[-1])()
            v = act(torch.nn.functional.linear(v, w["linear.weight"], w.get("linear.bias")))
    return v


@torch.no_grad()
def reference(model_dir: str | Path, prompts: list[list[int]], types: list[list[int]] | None = None):
    """transformers in float32, one prompt at a time (no padding), pooled as sentence-transformers pools
    (or, for a classifier, its logits, through sigmoid for one label as CrossEncoder applies it):
    [len(prompts), size]."""
    import transformers as t

    model_dir = Path(model_dir)
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    if arch.endswith("ForSequenceClassification"):
        model = getattr(t, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
        out = []
        for i, ids in enumerate(prompts):
            tt = torch.tensor([types[i]]) if types else None
            logits = model(torch.tensor([ids]), token_type_ids=tt).logits[0]
            out.append(torch.sigmoid(logits) if model.config.num_labels == 1 else logits)
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
        v = _apply_dense(model_dir, v)
        out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return torch.stack(out)
