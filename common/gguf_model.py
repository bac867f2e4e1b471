"""`--model x.gguf`: a GGUF file served directly, its weights never expanded on disk.

Every process that takes --model (launch, router, worker) calls model_dir(), which turns the file into a
small directory that the rest of the server reads like any checkpoint's: config.json (transformers'
reading of the file's metadata, plus quantization_config {"quant_method": "gguf", "file": the file},
which makes the worker load the weights from the file: shard_worker/model/quant/gguf.py),
generation_config.json, and the tokenizer, read from the file by transformers or copied from
--tokenizer DIR (vLLM's flag). It holds no weights (kilobytes to a few MB for a tokenizer) and is
written once per file under $TPSERVE_CACHE (default ~/.cache/tpserve)/gguf/<key>/<file stem>, keyed by
the file's path, size and mtime and the tokenizer directory, beside the target and renamed into place,
so concurrent processes each find it whole. The stem is the directory's name, hence the served model's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

RECIPE = 1  # bumped when what is written changes
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def is_gguf(model: str | Path) -> bool:
    return str(model).endswith(".gguf")


def cache_root() -> Path:
    return Path(os.environ.get("TPSERVE_CACHE", Path.home() / ".cache" / "tpserve")) / "gguf"


def model_dir(model: str, tokenizer: str | None = None) -> str:
    """The directory the server reads for --model (model itself unless it is a .gguf file)."""
    if not is_gguf(model):
        if tokenizer and not _is_gguf_dir(model):
            raise ValueError(f"--tokenizer {tokenizer}: only for a GGUF --model (x.gguf)")
        return model
    path = Path(model).resolve()
    if not path.is_file():
        raise ValueError(f"--model {model}: no such file")
    if tokenizer and not (Path(tokenizer) / "tokenizer_config.json").is_file():
        raise ValueError(f"--tokenizer {tokenizer}: no tokenizer_config.json there")
    stat = path.stat()
    tok = str(Path(tokenizer).resolve()) if tokenizer else ""
    key = hashlib.sha256(f"{RECIPE}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{tok}".encode()).hexdigest()
    out = cache_root() / key[:16] / path.stem
    if (out / "config.json").is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=out.parent))
    try:
        _write(path, tokenizer, work)
        work.chmod(0o755)  # mkdtemp's 0700 would keep other users of the cache out
        try:
            work.rename(out)
        except OSError:  # another process got there first: its copy is the same
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return str(out)


def _is_gguf_dir(model: str) -> bool:
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (config.get("quantization_config") or {}).get("quant_method") == "gguf"


def _write(path: Path, tokenizer: str | None, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # transformers' errors for an unknown architecture or a bad file vary
        raise ValueError(f"--model {path}: cannot read its GGUF metadata: {e}") from None
    if not config.architectures:  # the causal LM class of the model type, as transformers loads it
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if causal_lm is None:
            raise ValueError(f"--model {path}: model type {config.model_type!r} has no causal LM class")
        config.architectures = [causal_lm]
    config.save_pretrained(out)
    data = json.loads((out / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "gguf", "file": str(path)}
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    GenerationConfig.from_model_config(config).save_pretrained(out)
    if tokenizer:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer) / name).is_file():
                shutil.copy2(Path(tokenizer) / name, out / name)
        return
    try:
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    except Exception as e:
        raise ValueError(f"--model {path}: cannot read its tokenizer ({e}); give --tokenizer DIR") from None
