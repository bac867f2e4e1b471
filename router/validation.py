"""Checks a public GenerateRequest against the served model's limits before it reaches the scheduler.

Validation has two stages because the length rule needs the prompt's token count, and a text or chat
prompt only has one after tokenizing: `check_request_fields` runs first (cheap, and it bounds what the
tokenizer is asked to do), `check_prompt` after, with the prompt's ids (the router tokenizes between the
two, off its event loop). `validate_request` runs both around a synchronous tokenize.

Every failure is a ValidationError naming the field (proto path, e.g. "sampling.top_p") and the limit,
so the servicer can answer INVALID_ARGUMENT with a message a client can act on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.pb.tpserve.v1 import generation_pb2
from common.sampling import SamplingConfig
from router.chat import ChatPrompt, chat_prompt, check_chat
from router.choices import MAX_N
from router.sampling_checks import check_min_tokens, check_sampling, check_structured, with_bad_words
from router.validation_error import ValidationError

__all__ = ["Limits", "ValidatedRequest", "ValidationError", "check_request_fields", "validate_request"]


@dataclass(frozen=True)
class Limits:
    """What a request may ask for. vocab_size and max_model_len come from the loaded model."""

    vocab_size: int
    max_model_len: int
    max_stop_strings: int = 16
    max_top_logprobs: int = 20
    # None: a prompt may use all but one position of the context (one token must be generated).
    max_prompt_tokens: int | None = None
    # None: max_new_tokens is bounded only by max_model_len; an operator cap on output length.
    max_new_tokens: int | None = None
    # Text is checked before tokenizing, so a huge string is refused before it costs tokenizer time.
    # None: 64 characters per position of max_model_len, more than any real tokenizer packs in a token.
    max_prompt_chars: int | None = None
    # The stop-string matcher holds back up to this many characters, delaying streamed text by as much.
    max_stop_string_chars: int = 256
    max_request_id_chars: int = 256
    # max_new_tokens when the request leaves it unset (lowered to what fits in max_model_len).
    default_max_new_tokens: int = 256
    # What a request's unset sampling fields take: the model's generation_config.json defaults.
    sampling_defaults: SamplingConfig = SamplingConfig()
    max_chat_messages: int = 1024

    def __post_init__(self):
        for name in ("vocab_size", "max_stop_string_chars", "max_request_id_chars", "default_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_stop_strings", "max_top_logprobs"):
            if getattr(self, name) < 0:
                raise ValueError(f"Limits.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(
                f"Limits.max_model_len must be at least 2 (prompt + 1 token), got {self.max_model_len}"
            )
        if self.max_prompt_tokens is not None and not 1 <= self.max_prompt_tokens < self.max_model_len:
            raise ValueError(
                f"Limits.max_prompt_tokens must be in [1, max_model_len={self.max_model_len}), "
                f"got {self.max_prompt_tokens}"
            )
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"Limits.max_prompt_chars must be at least 1, got {self.max_prompt_chars}")

    @property
    def prompt_token_limit(self) -> int:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else self.max_model_len - 1

    @property
    def prompt_char_limit(self) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else 64 * self.max_model_len


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed every check, with every default resolved."""

    request_id: str  # empty: the router assigns one
    prompt_token_ids: tuple[int, ...]
    prompt_text: str | None  # None when the prompt came as token ids or messages
    max_new_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    top_logprobs: int
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # choices
    prompt_logprobs: int | None = None  # alternatives per prompt position; None: not wanted
    # A chat prompt's images as the checkpoint's processor prepared them, in prompt order: AddRequest's
    # PromptImage messages (placeholder span, content hash, pixels; router/media/render.py).
    images: tuple = ()


# The prompt's three forms; exactly one must be given.
PROMPT_FIELDS = ("text", "token_ids", "messages")


def prompt_field(req: generation_pb2.GenerateRequest) -> str:
    """Which form the prompt came in (the request passed check_request_fields)."""
    return "token_ids" if len(req.token_ids) else "messages" if len(req.messages) else "text"


def check_request_fields(req: generation_pb2.GenerateRequest, limits: Limits) -> SamplingConfig:
    """Checks everything that does not need the prompt's token count; returns the resolved sampling.

    max_new_tokens, when set, must be at least 1 (unset: the server's default, see check_prompt).
    """
    if len(req.request_id) > limits.max_request_id_chars:
        raise ValidationError(
            "request_id",
            f"request_id is {len(req.request_id)} characters; the limit is {limits.max_request_id_chars}",
        )
    given = [
        f
        for f, present in zip(PROMPT_FIELDS, (req.text, req.token_ids, req.messages), strict=True)
        if present
    ]
    if len(given) > 1:
        raise ValidationError(
            given[1], f"set exactly one of text, token_ids or messages, not {' and '.join(given)}"
        )
    if not given:
        raise ValidationError("text", "prompt is empty: set text, token_ids or messages (exactly one)")
    if len(req.text) > limits.prompt_char_limit:
        raise ValidationError(
            "text", f"text is {len(req.text)} characters; the limit is {limits.prompt_char_limit}"
        )
    if len(req.token_ids):
        _check_token_ids("token_ids", req.token_ids, limits.vocab_size)
    check_chat(req, limits.max_chat_messages, limits.prompt_char_limit)

    if req.HasField("max_new_tokens"):
        if req.max_new_tokens < 1:
            raise ValidationError("max_new_tokens", max_new_tokens_too_small(req.max_new_tokens))
        if limits.max_new_tokens is not None and req.max_new_tokens > limits.max_new_tokens:
            raise ValidationError(
                "max_new_tokens",
                f"max_new_tokens {req.max_new_tokens} exceeds the limit {limits.max_new_tokens}",
            )
        if req.max_new_tokens > limits.max_model_len - 1:
            raise ValidationError(
                "max_new_tokens",
                f"max_new_tokens {req.max_new_tokens} leaves no room for a prompt within "
                f"max_model_len {limits.max_model_len}",
            )

    sampling = check_sampling(req.sampling, limits.sampling_defaults, limits.vocab_size)
    check_structured(req.sampling, req.ignore_eos)

    if len(req.stop) > limits.max_stop_strings:
        raise ValidationError(
            "stop", f"{len(req.stop)} stop strings given; the limit is {limits.max_stop_strings}"
        )
    for i, stop in enumerate(req.stop):
        if not stop:
            raise ValidationError(
                f"stop[{i}]", f"stop[{i}] is empty; an empty stop string would match at once"
            )
        if len(stop) > limits.max_stop_string_chars:
            raise ValidationError(
                f"stop[{i}]",
                f"stop[{i}] is {len(stop)} characters; the limit is {limits.max_stop_string_chars}",
            )
    _check_token_ids("stop_token_ids", req.stop_token_ids, limits.vocab_size)

    if req.HasField("n") and not 1 <= req.n <= MAX_N:
        raise ValidationError("n", f"n must be in [1, {MAX_N}], got {req.n}")
    if req.HasField("prompt_logprobs") and req.prompt_logprobs > limits.max_top_logprobs:
        raise ValidationError(
            "prompt_logprobs",
            f"prompt_logprobs {req.prompt_logprobs} is above the limit of {limits.max_top_logprobs}",
        )
    if req.top_logprobs > limits.max_top_logprobs:
        raise ValidationError(
            "top_logprobs", f"top_logprobs {req.top_logprobs} is above the limit of {limits.max_top_logprobs}"
        )
    return sampling


def add_special_tokens(req: generation_pb2.GenerateRequest) -> bool:
    """Whether a text prompt gets the tokenizer's special tokens (BOS): yes unless the request says no."""
    return req.add_special_tokens if req.HasField("add_special_tokens") else True


def max_new_tokens_too_small(value: int, name: str = "max_new_tokens") -> str:
    """The one message for a length bound below 1, whichever API and whatever the value (-1 or 0)."""
    return f"{name} must be at least 1, got {value} (or leave it unset for the default)"


def check_prompt(
    req: generation_pb2.GenerateRequest, sampling: SamplingConfig, prompt_ids: Sequence[int], limits: Limits
) -> ValidatedRequest:
    """The second stage, with the prompt's token ids (the request's own, or the router's tokenization of
    its text or messages): the length rules, and max_new_tokens resolved."""
    field = prompt_field(req)
    prompt_ids = tuple(int(t) for t in prompt_ids)
    if req.HasField("max_new_tokens"):
        max_new_tokens = req.max_new_tokens
    else:
        room = limits.max_model_len - len(prompt_ids)
        cap = limits.max_new_tokens or limits.default_max_new_tokens
        max_new_tokens = max(1, min(limits.default_max_new_tokens, cap, room))
    check_prompt_tokens(prompt_ids, max_new_tokens, limits, prompt_field=field)
    check_min_tokens(sampling, max_new_tokens, explicit=req.HasField("max_new_tokens"))
    return ValidatedRequest(
        request_id=req.request_id,
        prompt_token_ids=prompt_ids,
        prompt_text=req.text or None,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        top_logprobs=req.top_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        n=req.n if req.HasField("n") else 1,
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
    )


def check_prompt_tokens(
    token_ids: Sequence[int], max_new_tokens: int, limits: Limits, *, prompt_field: str = "token_ids"
) -> None:
    """Checks the tokenized prompt: non-empty, ids in the vocabulary, and room left to generate.

    prompt_field names the field the prompt came in ("text" when the router tokenized it), so the
    error points at what the client sent.
    """
    n = len(token_ids)
    if n == 0:
        # Only reachable for text that tokenizes to nothing; token_ids prompts are caught earlier.
        raise ValidationError(prompt_field, f"{prompt_field} is empty after tokenization")
    if prompt_field == "token_ids":
        _check_token_ids("token_ids", token_ids, limits.vocab_size)
    elif max(token_ids) >= limits.vocab_size:
        # The tokenizer knows ids the model does not (added tokens past the embedding): a server
        # misconfiguration, but the request still must not reach the model.
        raise ValidationError(
            prompt_field,
            f"{prompt_field} tokenizes to id {max(token_ids)}, not below vocab_size {limits.vocab_size}",
        )
    if n > limits.prompt_token_limit:
        raise ValidationError(
            prompt_field,
            f"{prompt_field} is {n} tokens; the limit is {limits.prompt_token_limit} "
            f"(max_model_len {limits.max_model_len})",
        )
    if n + max_new_tokens > limits.max_model_len:
        raise ValidationError(
            "max_new_tokens",
            f"prompt length {n} + max_new_tokens {max_new_tokens} = {n + max_new_tokens} "
            f"exceeds max_model_len {limits.max_model_len}",
        )


def validate_request(
    req: generation_pb2.GenerateRequest,
    limits: Limits,
    tokenize: Callable[..., Sequence[int]] | None = None,
    render_chat: Callable[[ChatPrompt], Sequence[int]] | None = None,
    tokenize_words: Callable[[str], list[int]] | None = None,
) -> ValidatedRequest:
    """Both stages, with the router's tokenizer as synchronous calls: tokenize(text[, add_special_tokens])
    for text prompts, render_chat(prompt) for chat prompts, tokenize_words(word) (no special tokens) for
    sampling.bad_words. A token-id prompt without bad_words needs none of them."""
    sampling = check_request_fields(req, limits)
    if req.sampling.bad_words:
        if tokenize_words is None:
            raise TypeError("validate_request needs tokenize_words for sampling.bad_words")
        sampling = with_bad_words(sampling, req.sampling.bad_words, tokenize_words, limits.vocab_size)
    if len(req.token_ids):
        prompt_ids = req.token_ids
    elif len(req.messages):
        if render_chat is None:
            raise TypeError("validate_request needs render_chat for a chat prompt")
        prompt_ids = render_chat(chat_prompt(req))
    else:
        if tokenize is None:
            raise TypeError("validate_request needs tokenize for a text prompt")
        prompt_ids = tokenize(req.text) if add_special_tokens(req) else tokenize(req.text, False)
    return check_prompt(req, sampling, prompt_ids, limits)


def _check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    # max() first: one pass in C for the common all-valid case; the index is only looked up on failure.
    if token_ids and max(token_ids) >= vocab_size:
        i = next(i for i, t in enumerate(token_ids) if t >= vocab_size)
        raise ValidationError(
            f"{field}[{i}]", f"{field}[{i}] = {token_ids[i]} is not below vocab_size {vocab_size}"
        )
