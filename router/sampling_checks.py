"""Checks a request's SamplingParams and resolves them into the SamplingConfig the worker samples with.

The ranges are OpenAI's where it has one (temperature [0, 2], penalties [-2, 2], logit_bias [-100, 100]
with at most 300 entries) and vLLM's for its extensions. bad_words are tokenized here, as vLLM does, into
the bad_words_token_ids that travel to the worker: the router owns the tokenizer. A structured output's
grammar is compiled here once (check_structured), so that one that cannot be is refused before it is
queued; rank 0 compiles it again for its own tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from common import grammar
from common.pb.tpserve.v1 import generation_pb2
from common.sampling import SamplingConfig
from router.validation_error import ValidationError

# Temperatures below this are greedy decoding (vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's API range
# Presence and frequency penalties: OpenAI's range.
MAX_PENALTY = 2.0
# Beyond this a repetition penalty only pushes logits toward overflow; no sensible use needs it.
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
# bad_words and bad_words_token_ids: each entry is a processor's work per step, so both are bounded.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 64
# A grammar's text: a JSON Schema of tools for an agent runs to tens of kilobytes, not megabytes.
MAX_GRAMMAR_CHARS = 256 * 1024


def check_sampling(params: generation_pb2.SamplingParams, defaults: SamplingConfig, vocab_size: int):
    """The request's sampling with unset fields from `defaults`, every range checked. bad_words are checked
    here but tokenized later (with_bad_words), once the tokenizer's thread runs the request."""
    cfg = SamplingConfig.from_proto(params, defaults)
    floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    for name in floats:
        value = getattr(cfg, name)
        if not math.isfinite(value):
            raise ValidationError(f"sampling.{name}", f"sampling.{name} must be a finite number, got {value}")
    if not 0 <= cfg.temperature <= MAX_TEMPERATURE:
        raise ValidationError(
            "sampling.temperature",
            f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}], got {cfg.temperature:g}",
        )
    if not 0 < cfg.top_p <= 1:
        raise ValidationError("sampling.top_p", f"sampling.top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.top_k < 0:
        raise ValidationError("sampling.top_k", f"sampling.top_k must be >= 0 (0 = all), got {cfg.top_k}")
    if not 0 <= cfg.min_p <= 1:
        raise ValidationError("sampling.min_p", f"sampling.min_p must be in [0, 1], got {cfg.min_p}")
    if not 0 < cfg.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise ValidationError(
            "sampling.repetition_penalty",
            f"sampling.repetition_penalty must be > 0 and at most {MAX_REPETITION_PENALTY}, "
            f"got {cfg.repetition_penalty}",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(cfg, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValidationError(
                f"sampling.{name}", f"sampling.{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}"
            )
    _check_logit_bias(cfg.logit_bias, vocab_size)
    _check_bad_words(params, vocab_size)
    if 0 < cfg.temperature < GREEDY_BELOW:
        # As vLLM does: dividing logits by a temperature this small overflows them (a float32 denormal
        # even flushes to zero on the CPU); it means greedy, and greedy is what travels.
        cfg = dataclasses.replace(cfg, temperature=0.0)
    return cfg


def check_min_tokens(cfg: SamplingConfig, max_new_tokens: int, explicit: bool) -> None:
    """min_tokens may not exceed the output's length bound (vLLM: min_tokens <= max_tokens)."""
    if cfg.min_tokens > max_new_tokens:
        which = "max_new_tokens" if explicit else "the default max_new_tokens"
        raise ValidationError(
            "sampling.min_tokens",
            f"sampling.min_tokens {cfg.min_tokens} is above {which} {max_new_tokens}",
        )


def with_bad_words(
    cfg: SamplingConfig, words: Sequence[str], encode: Callable[[str], list[int]], vocab_size: int
) -> SamplingConfig:
    """cfg with `words` tokenized into bad_words_token_ids after any given directly. encode: the
    tokenizer without special tokens. As vLLM: each word as it starts a text, and with a leading space as
    it follows one, the second kept only where the space makes it another first token of the same
    length (where it does not, the first form already covers it)."""
    found = []
    for i, word in enumerate(words):
        plain = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        for form in (plain, spaced) if spaced[:1] != plain[:1] and len(spaced) == len(plain) else (plain,):
            if not form:
                raise ValidationError(
                    f"sampling.bad_words[{i}]", f"sampling.bad_words[{i}] tokenizes to nothing"
                )
            if max(form) >= vocab_size:
                raise ValidationError(
                    f"sampling.bad_words[{i}]",
                    f"sampling.bad_words[{i}] tokenizes to id {max(form)}, not below vocab_size {vocab_size}",
                )
            found.append(tuple(form))
    return dataclasses.replace(cfg, bad_words_token_ids=cfg.bad_words_token_ids + tuple(found))


def _check_logit_bias(bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValidationError(
            "sampling.logit_bias",
            f"sampling.logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}",
        )
    for token_id, value in bias:  # sorted by id: the first out of range is the smallest
        if token_id >= vocab_size:
            raise ValidationError(
                "sampling.logit_bias",
                f"sampling.logit_bias: token id {token_id} is not below vocab_size {vocab_size}",
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN fails this too
            raise ValidationError(
                "sampling.logit_bias",
                f"sampling.logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value}",
            )


def _check_bad_words(params: generation_pb2.SamplingParams, vocab_size: int) -> None:
    words, sequences = params.bad_words, params.bad_words_token_ids
    if len(words) + len(sequences) > MAX_BAD_WORDS:
        raise ValidationError(
            "sampling.bad_words",
            f"{len(words) + len(sequences)} bad words given; the limit is {MAX_BAD_WORDS}",
        )
    for i, word in enumerate(words):
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise ValidationError(
                f"sampling.bad_words[{i}]",
                f"sampling.bad_words[{i}] must be 1 to {MAX_BAD_WORD_CHARS} characters, not all spaces",
            )
    for i, seq in enumerate(sequences):
        field = f"sampling.bad_words_token_ids[{i}]"
        if not 1 <= len(seq.ids) <= MAX_BAD_WORD_TOKENS:
            raise ValidationError(field, f"{field} must hold 1 to {MAX_BAD_WORD_TOKENS} token ids")
        if max(seq.ids) >= vocab_size:
            raise ValidationError(
                field, f"{field} holds id {max(seq.ids)}, not below vocab_size {vocab_size}"
            )


def check_structured(params: generation_pb2.SamplingParams, ignore_eos: bool) -> None:
    """Compiles sampling.structured_output's grammar (llguidance's checker, no tokenizer: well under a
    millisecond for a typical schema, but it runs on the tokenizer's threads like the rest). The field
    named is the oneof member given, e.g. sampling.structured_output.json_schema."""
    if not params.HasField("structured_output"):
        return
    msg = params.structured_output
    kind = msg.WhichOneof("kind")
    field = f"sampling.structured_output.{kind or 'kind'}"
    if kind is None:
        raise ValidationError(
            "sampling.structured_output", "sampling.structured_output: set one of " + ", ".join(grammar.KINDS)
        )
    if ignore_eos:
        # The grammar ends the output with EOS once complete; past it nothing can follow.
        raise ValidationError("ignore_eos", "ignore_eos cannot be used with sampling.structured_output")
    spec = grammar.GrammarSpec.from_proto(msg)
    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise ValidationError(
            field, f"{field} is {len(spec.text)} characters; the limit is {MAX_GRAMMAR_CHARS}"
        )
    try:
        grammar.validate(spec)
    except grammar.GrammarError as e:
        raise ValidationError(field, f"{field} does not compile: {e}") from None
