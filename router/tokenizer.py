"""The model's tokenizer as the router uses it: prompts (text, or a conversation rendered with the
checkpoint's chat template) are encoded on a worker thread, never on the event loop, so one huge prompt
does not stall every other stream's tokens while it is tokenized.

Fast (Rust) tokenizers release the GIL while they encode, so the loop keeps running meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("tpserve.router")

# What a Hugging Face checkpoint's tokenizer comes as (any one will do for AutoTokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class NoChatTemplate(ValueError):
    """The model has no chat template, so a conversation cannot be rendered."""


class NoTokenizer(ValueError):
    """The model directory has no tokenizer (a --load-format dummy benchmark): token ids only."""


class Tokenizer:
    def __init__(self, hf_tokenizer, threads: int = 2):
        """hf_tokenizer None: the model came without one; prompts must be token ids, and output text
        is empty."""
        self.hf = hf_tokenizer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    @classmethod
    def from_pretrained(cls, model_dir: str) -> Tokenizer:
        from transformers import AutoTokenizer

        if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
            log.warning(
                "%s has no tokenizer: prompts must be token ids, and responses carry no text", model_dir
            )
            return cls(None)
        try:
            return cls(AutoTokenizer.from_pretrained(model_dir))
        except (OSError, ValueError, TypeError) as e:  # a start-up error: one line, not a traceback
            reason = " ".join(str(e).split())
            raise ValueError(f"--model {model_dir}: cannot read its tokenizer: {reason}") from None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        if self.hf is None:
            raise NoTokenizer("the model has no tokenizer: send the prompt as token_ids")
        return self.hf(text)["input_ids"]

    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The conversation in the model's own template, ending with the assistant's generation prompt;
        the ids transformers' apply_chat_template(..., add_generation_prompt=True) gives."""
        if self.hf is None:
            raise NoTokenizer("the model has no tokenizer: send the prompt as token_ids")
        if not self.has_chat_template:
            raise NoChatTemplate("the model has no chat template: send the prompt as text or token_ids")
        text = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        # The template writes the special tokens it wants (BOS included) itself.
        return self.hf(text, add_special_tokens=False)["input_ids"]

    async def run(self, fn, *args):
        """fn(*args) on the tokenizer's threads (it tokenizes: never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        return "" if self.hf is None else self.hf.decode(ids, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
