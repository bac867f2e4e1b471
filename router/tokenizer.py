"""The model's tokenizer as the router uses it: prompts (text, or a conversation rendered with the
checkpoint's chat template) are encoded on a worker thread, never on the event loop, so one huge prompt
does not stall every other stream's tokens while it is tokenized; output text is decoded on another
(`decoding`).

Fast (Rust) tokenizers release the GIL while they encode, so the loop keeps running meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2

from router.chat import ChatPrompt
from router.off_loop import OffLoop
from router.validation_error import ValidationError

log = logging.getLogger("tpserve.router")

# What a Hugging Face checkpoint's tokenizer comes as (any one will do for AutoTokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class NoChatTemplate(ValueError):
    """The model has no chat template, so a conversation cannot be rendered."""


class NoTokenizer(ValueError):
    """The model directory has no tokenizer (a --load-format dummy benchmark): token ids only."""


def _tokenizer_class(model_dir: str):
    """The class tokenizer_config.json names (what AutoTokenizer would pick), imported by name: AutoTokenizer
    itself reads config.json through transformers' model configuration code, which imports torch (4 s
    and hundreds of MB that a router never uses). Without a name, or one transformers lacks:
    AutoTokenizer."""
    import transformers

    config = Path(model_dir) / "tokenizer_config.json"
    try:
        name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    except (OSError, ValueError):
        name = None
    if isinstance(name, str):
        for candidate in (name, f"{name}Fast"):
            found = getattr(transformers, candidate, None)
            if isinstance(found, type) and hasattr(found, "from_pretrained"):
                return found
    return transformers.AutoTokenizer


class Tokenizer:
    def __init__(self, hf_tokenizer, threads: int = 2):
        """hf_tokenizer None: the model came without one; prompts must be token ids, and output text
        is empty."""
        self.hf = hf_tokenizer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        # Streamed text is decoded on a thread of its own, batched across requests (router/off_loop.py), so
        # a long prompt being tokenized never holds up every stream's next token.
        self._decode_thread = ThreadPoolExecutor(1, thread_name_prefix="detokenize")
        self.decoding = OffLoop(self._decode_thread)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> Tokenizer:
        if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
            log.warning(
                "%s has no tokenizer: prompts must be token ids, and responses carry no text", model_dir
            )
            return cls(None)
        try:
            return cls(_tokenizer_class(model_dir).from_pretrained(model_dir))
        except (OSError, ValueError, TypeError) as e:  # a start-up error: one line, not a traceback
            reason = " ".join(str(e).split())
            raise ValueError(f"--model {model_dir}: cannot read its tokenizer: {reason}") from None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hf is None:
            raise NoTokenizer("the model has no tokenizer: send the prompt as token_ids")
        return self.hf(text, add_special_tokens=add_special_tokens)["input_ids"]

    def encode_words(self, text: str) -> list[int]:
        """A piece of text as it would appear inside an output: no BOS or other special tokens."""
        return self.encode(text, add_special_tokens=False)

    def render_chat(self, prompt: ChatPrompt) -> list[int]:
        """The conversation in the model's own template: the ids transformers' apply_chat_template gives
        for the same messages, tools and options. A template that fails on them (it raised, or the last
        message to continue is not in its output) is a ValidationError on messages."""
        # The template writes the special tokens it wants (BOS included) itself.
        return self.hf(self.chat_text(prompt), add_special_tokens=prompt.add_special_tokens)["input_ids"]

    def chat_text(self, prompt: ChatPrompt) -> str:
        """render_chat's text, before tokenizing (a processor tokenizes it with its images)."""
        if self.hf is None:
            raise NoTokenizer("the model has no tokenizer: send the prompt as token_ids")
        if not self.has_chat_template:
            raise NoChatTemplate("the model has no chat template: send the prompt as text or token_ids")
        try:
            text = self.hf.apply_chat_template(
                prompt.messages,
                tools=prompt.tools,
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                tokenize=False,
                **(prompt.template_kwargs or {}),
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
            reason = " ".join(str(e).split())
            raise ValidationError(
                "messages", f"the model's chat template failed on messages: {reason}"
            ) from None
        return text

    async def run(self, fn, *args):
        """fn(*args) on the tokenizer's threads (it tokenizes: never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        return "" if self.hf is None else self.hf.decode(ids, **kwargs)

    def decode_each(self, ids: Sequence[int]) -> list[str]:
        """Each token's text alone (logprobs' alternatives), in one batched call."""
        if self.hf is None:
            return [""] * len(ids)
        return self.hf.batch_decode([[i] for i in ids])

    def is_special(self, token_id: int) -> bool:
        """Whether decoding with skip_special_tokens drops this token's text."""
        if self.hf is None:
            return False
        added = self.hf.added_tokens_decoder.get(token_id)
        return token_id in self.hf.all_special_ids or (added is not None and added.special)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's own strings for ids (vLLM's /tokenize token_strs), e.g. "Ġworld"."""
        if self.hf is None:
            raise NoTokenizer("the model has no tokenizer")
        return self.hf.convert_ids_to_tokens(list(ids))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._decode_thread.shutdown(wait=False, cancel_futures=True)
