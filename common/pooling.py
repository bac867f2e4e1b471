"""What a checkpoint says about serving it for pooling (embeddings, scores): which runner, how hidden states
become one vector, and how long an input may be. Read by the shard worker (it pools) and the router (it
validates and renders). Plain Python over the checkpoint's JSON files: no torch.

sentence-transformers' layout: modules.json lists the modules in order (Transformer, Pooling, Dense,
Normalize); 1_Pooling/config.json says the pooling mode; each Dense module's folder (2_Dense) its
config.json (in_features, out_features, bias, activation_function) and its linear's weights;
sentence_bert_config.json the max_seq_length.
A cross-encoder is a *ForSequenceClassification checkpoint: its head's logits, then sentence-transformers'
default activation (sigmoid for one label, none for several).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RUNNERS = ("auto", "generate", "pooling")
POOLING_METHODS = ("cls", "mean", "max", "last")
# Architectures with no causal LM head: served only for pooling.
ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "RobertaModel")
CROSS_ENCODER_SUFFIX = "ForSequenceClassification"
ENCODER_PREFIXES = ("Bert", "XLMRoberta", "Roberta")
# Pooling/config.json's flags -> our method names (the first set one wins, as sentence-transformers reads
# them in this order).
_ST_MODES = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_lasttoken", "last"),
)


# Dense modules' activation_function (a torch.nn class's full name) -> the name the worker applies.
DENSE_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
}


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers Dense module: activation(linear(pooled)), after pooling and before
    Normalize (Matryoshka-style projections of Qwen3-Embedding's kin, or sentence-t5's)."""

    path: str  # its folder in the checkpoint: config.json and model.safetensors (or pytorch_model.bin)
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a value of DENSE_ACTIVATIONS


@dataclass(frozen=True)
class PoolingConfig:
    method: str  # one of POOLING_METHODS
    normalize: bool  # unit length after pooling (sentence-transformers' Normalize module)
    cross_encoder: bool  # a classification head gives the output (its logits), not the pooled states
    activation: str = "none"  # a cross-encoder's: "sigmoid" for one label, else "none"
    max_seq_length: int | None = None  # sentence_bert_config.json's cap on an input's tokens
    dense: tuple[DenseModule, ...] = ()  # applied in order after pooling, before Normalize


def _read(path: Path) -> dict | list | None:
    """A checkpoint's JSON file, None when absent; ValueError naming the file when it does not parse (the
    worker's one-line refusal must say which file)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None  # as the model loader says it


def architecture(model_dir: str | Path) -> str:
    archs = (_read(Path(model_dir) / "config.json") or {}).get("architectures") or [""]
    return archs[0]


def resolve_runner(runner: str, model_dir: str | Path) -> str:
    """--runner as served: auto is pooling for an encoder architecture, a cross-encoder, or a checkpoint
    with sentence-transformers' modules.json, generate otherwise. ValueError for an encoder asked to
    generate."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {RUNNERS}, got {runner!r}")
    arch = architecture(model_dir)
    encoder = arch in ENCODER_ARCHITECTURES or arch.endswith(CROSS_ENCODER_SUFFIX)
    if runner == "generate" and encoder:
        raise ValueError(f"--runner generate: {arch} has no language-model head; use --runner pooling")
    if runner != "auto":
        return runner
    return "pooling" if encoder or (Path(model_dir) / "modules.json").is_file() else "generate"


def pooling_config(model_dir: str | Path) -> PoolingConfig:
    """How model_dir's hidden states become its outputs. Without sentence-transformers' files: CLS for
    an encoder (BERT's convention), the last token for a decoder (Qwen3-Embedding's). ValueError for a
    module this server does not apply (a pooling mode or an activation it does not know, a module it
    does not know)."""
    root = Path(model_dir)
    arch = architecture(root)
    config = _read(root / "config.json") or {}
    if arch.endswith(CROSS_ENCODER_SUFFIX):
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or 1
        # An encoder's head reads [CLS]; a decoder's (Qwen3-Reranker converted) its last token.
        method = "cls" if arch.startswith(ENCODER_PREFIXES) else "last"
        return PoolingConfig(method, False, True, "sigmoid" if labels == 1 else "none", _max_seq(root))
    modules = _read(root / "modules.json")
    if modules is None:
        return PoolingConfig("cls" if arch in ENCODER_ARCHITECTURES else "last", False, False)
    method, normalize, dense = None, False, []
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            method = _st_method(_read(root / module.get("path", "") / "config.json") or {})
        elif kind == "Dense":
            dense.append(_dense(root, module.get("path", "")))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"modules.json: the {kind} module ({module.get('path')}) is not served")
    if method is None:
        method = "cls" if arch in ENCODER_ARCHITECTURES else "last"
    return PoolingConfig(method, normalize, False, "none", _max_seq(root), tuple(dense))


def _dense(root: Path, path: str) -> DenseModule:
    config = _read(root / path / "config.json") or {}
    name = config.get("activation_function", "torch.nn.modules.activation.Tanh")  # Dense's default
    if name not in DENSE_ACTIVATIONS:
        raise ValueError(
            f"{path}/config.json: activation_function {name!r} is not served; served: "
            + ", ".join(k.rsplit(".", 1)[-1] for k in DENSE_ACTIVATIONS)
        )
    try:
        return DenseModule(
            path, int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True)),
            DENSE_ACTIVATIONS[name],
        )  # fmt: skip
    except KeyError as e:
        raise ValueError(f"{path}/config.json has no {e.args[0]}") from None


def labels(model_dir: str | Path) -> list[str]:
    """A classifier's label names by index (config.json's id2label), LABEL_i where it names none."""
    config = _read(Path(model_dir) / "config.json") or {}
    id2label = config.get("id2label") or {}
    count = config.get("num_labels") or len(id2label) or 1
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]


def _st_method(pooling: dict) -> str:
    """The one pooling mode the file sets (sentence-transformers concatenates several: not served)."""
    enabled = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v is True)
    names = dict(_ST_MODES)
    if len(enabled) == 1 and enabled[0] in names:
        return names[enabled[0]]
    mode = pooling.get("pooling_mode")  # newer files name it directly
    if not enabled and mode in ("cls", "mean", "max", "lasttoken"):
        return "last" if mode == "lasttoken" else mode
    raise ValueError(
        f"1_Pooling/config.json: pooling modes {enabled or mode} are not served (one of cls, "
        "mean, max, last token is)"
    )


def _max_seq(root: Path) -> int | None:
    value = (_read(root / "sentence_bert_config.json") or {}).get("max_seq_length")
    return int(value) if value else None
