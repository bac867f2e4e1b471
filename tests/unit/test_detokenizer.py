"""The incremental detokenizer against tokenizer.decode of the whole sequence, the independent reference.

Two small tokenizers trained here (independent of shard_worker/model/builder.py): a GPT-2 / Llama 3 style
byte-level BPE, and a Llama 2 / Mistral style SentencePiece BPE with byte fallback, whose decoder drops
the first token's leading space (so a token's text depends on its left context).
"""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from router.detokenizer import REPLACEMENT, IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! A café, a naïve résumé, and a façade.",
    "日本語のテキストです。東京は大きい。",
    "emoji test 🙂 🎉 👍 done",
    "Numbers 12345 and symbols #$%&*() end.",
] * 20

# Characters the tokenizers never saw in training, so they come out as several byte tokens.
HARD_TEXTS = [
    "plain ascii text",
    "é è ê ë à ç ñ ü ö",
    "日本 中文 한국어 ไทย",
    "🙂🎉👍 👩‍👩‍👧 🏳️‍🌈 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "mixed: naïve 日本語 🙂 Ωμέγα ∑∫ end",
    "  leading spaces and\nnew lines\n\n",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, to name the token of a single byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@pytest.fixture(scope="module")
def byte_level():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.byte_token = {b: hf.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    return hf


@pytest.fixture(scope="module")
def sentencepiece_style():
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], limit_alphabet=40
    )
    tok.train_from_iterator(CORPUS, trainer)
    # The trainer made the byte tokens "special"; in a real SentencePiece vocabulary they are ordinary
    # pieces, and skip_special_tokens must not drop them.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    tok = Tokenizer.from_str(json.dumps(spec))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.byte_token = {b: hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    hf.byte_fallback = True
    return hf


@pytest.fixture(params=["byte_level", "sentencepiece_style"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def expected_output(tokenizer, prompt, output):
    """What the output adds to the prompt's text in a decode of everything."""
    full = decode(tokenizer, prompt + output)
    prompt_text = decode(tokenizer, prompt)
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


def stream(tokenizer, prompt, output, rng=None):
    """Pushes output in random chunks (or one token at a time); returns (pushed pieces, flushed)."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces, i = [], 0
    while i < len(output):
        size = rng.randint(1, 4) if rng else 1
        pieces.append(detok.push(output[i : i + size]))
        i += size
    return pieces, detok.flush()


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_test_tokenizers_really_split_characters(tokenizer):
    # Guards the other tests: they mean something only if characters are split over tokens.
    ids = encode(tokenizer, "日本 🙂 é 𝔘")
    assert any(REPLACEMENT in decode(tokenizer, [t]) for t in ids)
    assert decode(tokenizer, ids) == "日本 🙂 é 𝔘"


@pytest.mark.parametrize("text", HARD_TEXTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_valid_text_streams_without_replacement_characters(tokenizer, text, chunked):
    prompt = encode(tokenizer, "Q: say it. A:")
    output = encode(tokenizer, text)
    pieces, flushed = stream(tokenizer, prompt, output, random.Random(1) if chunked else None)
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert "".join(pieces) + flushed == expected_output(tokenizer, prompt, output)
    assert flushed == ""


def test_split_characters_byte_by_byte(tokenizer):
    # Worst case: every byte of every multi-byte character is its own token.
    text = "aé日🙂👩‍👧𝔘z"
    output = [tokenizer.byte_token[b] for b in text.encode()]
    pieces, flushed = stream(tokenizer, encode(tokenizer, "Hello"), output)
    assert "".join(pieces) == text and flushed == ""
    assert all(REPLACEMENT not in p for p in pieces)
    # Text is sent as soon as each character is complete, not later.
    assert [p for p in pieces if p] == list(text)


def test_left_context_keeps_leading_spaces(sentencepiece_style):
    tok = sentencepiece_style
    prompt = encode(tok, "Say:")
    output = encode(tok, "Say: Hello world café")[len(prompt) :]
    assert decode(tok, output[-1:]) == decode(tok, output[-1:]).lstrip()  # alone, the space is dropped
    pieces, flushed = stream(tok, prompt, output)
    assert "".join(pieces) + flushed == " Hello world café"


def random_output(tokenizer, rng, length):
    """Random ids, uniform over the vocabulary for byte-level BPE. Byte fallback decodes a whole run of
    byte tokens at once and turns all of it to U+FFFD if any byte is invalid, so even
    tokenizer.decode is not prefix-stable there; its byte tokens come as the bytes of whole
    characters instead (still one token per byte)."""
    if not hasattr(tokenizer, "byte_fallback"):
        return [rng.randrange(len(tokenizer)) for _ in range(length)]
    byte_ids = set(tokenizer.byte_token.values())
    pieces = [t for t in range(len(tokenizer)) if t not in byte_ids]
    output = []
    while len(output) < length:
        if rng.random() < 0.3:
            char = rng.choice("é日🙂𝔘ñΩ한")
            output += [tokenizer.byte_token[b] for b in char.encode()]
        else:
            output.append(rng.choice(pieces))
    return output


@pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 5, 7, 10, 16, 33, 64, 100, 257, 600])
def test_random_tokens_match_full_decode(tokenizer, length):
    rng = random.Random(length)
    for trial in range(20):
        prompt = encode(tokenizer, rng.choice(CORPUS + HARD_TEXTS))[: rng.randint(1, 12)]
        prompt = encode(tokenizer, decode(tokenizer, prompt).rstrip(REPLACEMENT) or "A")
        output = random_output(tokenizer, rng, length)
        pieces, flushed = stream(tokenizer, prompt, output, rng if trial % 2 else None)
        assert "".join(pieces) + flushed == expected_output(tokenizer, prompt, output), (prompt, output)


def test_random_byte_soup_matches_full_decode(byte_level):
    # Mostly bytes >= 0x80: long runs of invalid UTF-8 that exercise the forced-release path.
    tok = byte_level
    rng = random.Random(7)
    for length in (5, 20, 100, 400):
        for _ in range(20):
            output = [tok.byte_token[rng.choice(range(0x80, 0x100))] for _ in range(length)]
            prompt = encode(tok, "hi")
            pieces, flushed = stream(tok, prompt, output, rng)
            assert "".join(pieces) + flushed == expected_output(tok, prompt, output)


def test_invalid_bytes_are_sent_without_waiting_for_the_end(tokenizer):
    lone = tokenizer.byte_token[0x80]
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hello"))
    sent = "".join(detok.push([lone]) for _ in range(50))
    assert sent.count(REPLACEMENT) >= 40  # held at most a few tokens
    assert sent + detok.flush() == expected_output(tokenizer, encode(tokenizer, "Hello"), [lone] * 50)


def test_invalid_byte_then_valid_character(byte_level):
    tok = byte_level
    b = tok.byte_token
    pieces, flushed = stream(tok, encode(tok, "Hello"), [b[0x80], b[0xE6], b[0x97], b[0xA5], b[0x41]])
    assert "".join(pieces) + flushed == REPLACEMENT + "日A"
    assert REPLACEMENT + "日" in pieces


def test_unfinished_character_comes_out_at_flush(tokenizer):
    b = tokenizer.byte_token
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hello"))
    assert detok.push([b[0x41], b[0xE6], b[0x97]]) == "A"
    assert REPLACEMENT in detok.flush()
    assert detok.flush() == ""


def test_prompt_ending_inside_a_character(byte_level):
    tok = byte_level
    b = tok.byte_token
    detok = IncrementalDetokenizer(tok, encode(tok, "hello ") + [b[0xE6], b[0x97]])
    assert detok.push([b[0xA5]]) == "日"
    assert detok.push(encode(tok, " ok")) == " ok"


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    prompt = encode(tokenizer, "Q:")
    output = encode(tokenizer, "Q: Hello world")[len(prompt) :]
    output = output[:1] + [eos, tokenizer.bos_token_id] + output[1:] + [eos]
    pieces, flushed = stream(tokenizer, prompt, output)
    text = "".join(pieces) + flushed
    assert "</s>" not in text and "<s>" not in text
    assert text == expected_output(tokenizer, prompt, output) == " Hello world"


def test_batched_push_equals_one_at_a_time(tokenizer):
    prompt = encode(tokenizer, "Q:")
    output = encode(tokenizer, " ".join(HARD_TEXTS))
    one, flushed_one = stream(tokenizer, prompt, output)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.push(output) + detok.flush() == "".join(one) + flushed_one


class CountingTokenizer:
    """Records how many ids each decode call was given."""

    def __init__(self, inner):
        self.inner = inner
        self.lengths = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("kind", ["text", "invalid"])
def test_cost_per_token_does_not_grow_with_output(tokenizer, kind):
    if kind == "text":
        output = encode(tokenizer, " ".join(CORPUS + HARD_TEXTS * 20))
    else:
        output = [tokenizer.byte_token[0x80 + i % 64] for i in range(3000)]
    assert len(output) > 1500
    prompt = encode(tokenizer, " ".join(CORPUS))  # a long prompt must not be re-decoded either
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, prompt)
    counting.lengths.clear()
    for token in output:
        detok.push([token])
    assert (
        max(counting.lengths)
        <= 2 * IncrementalDetokenizer.CONTEXT_TOKENS + 4 * IncrementalDetokenizer.MAX_PARTIAL
    )
    assert sum(counting.lengths) <= 40 * len(output)
    # Old ids are dropped, so memory does not grow with the output either.
    assert len(detok._ids) < 2 * IncrementalDetokenizer._TRIM_AT


def test_text_goes_out_as_soon_as_it_is_final(byte_level):
    # "日本語のテキスト" trains into tokens that each end mid-character ('æĹ¥æľ¬è', 'ªŀãģ®ãĥ', ...),
    # so no token boundary falls between characters for several tokens; the characters must not wait.
    tok = byte_level
    prompt = encode(tok, "Q:")
    output = encode(tok, " 日本語のテキストです。東京は大きい。 🙂👍 𝔘𝔫𝔦")
    detok = IncrementalDetokenizer(tok, prompt)
    sent = ""
    for i, token in enumerate(output):
        sent += detok.push([token])
        assert sent == expected_output(tok, prompt, output[: i + 1]).rstrip(REPLACEMENT)


def test_forced_release_in_a_long_run_of_straddling_tokens(byte_level):
    # A run of tokens that all end mid-character, longer than the bound on held tokens: the window
    # must move on without turning valid characters into U+FFFD.
    class ShortHold(IncrementalDetokenizer):
        MAX_HELD_TOKENS = 2

    tok = byte_level
    prompt = encode(tok, "Q:")
    output = encode(tok, "日本語のテキストです。東京は大きい。" * 3)
    detok = ShortHold(tok, prompt)
    pieces = [detok.push([t]) for t in output]
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == "日本語のテキストです。東京は大きい。" * 3
