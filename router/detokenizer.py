"""Turns generated token ids into text as they arrive, without splitting characters.

A byte-level token can end in the middle of a UTF-8 character (an emoji or a CJK character is often
two or three tokens), and decoding it alone gives U+FFFD. Some tokenizers also render a token
differently depending on what precedes it (SentencePiece drops the leading space of a text's first
token). So each new token is decoded together with a few tokens before it, and only the part of the
text that grew past that context is sent: the prefix/read-offset scheme of TGI and vLLM.

- prefix: where the decoded window starts. It is always a position after a complete character,
  so a decoder that fuses byte tokens (SentencePiece byte fallback) never sees half a character.
- read: the last token boundary that fell between complete characters. Tokens after it are held
  until they do; the complete characters among them are sent at once, the unfinished tail waits.

Tokens are decoded one at a time, so each costs a decode of the window (a few tokens), whatever the
length of the output. Invalid bytes would otherwise hold text back forever: once more U+FFFD pile up
at the end than an unfinished character can produce, they are final and are sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    # Complete-character positions kept as left context; a few are enough for every decoder we know
    # (the leading-space rule only looks at the first token), and more would only cost decode time.
    CONTEXT_TOKENS = 4
    # An unfinished UTF-8 character has at most 3 bytes, so it spans at most 3 tokens and decodes to
    # at most 3 U+FFFD (one per byte with byte fallback, one in all with byte-level BPE).
    MAX_PARTIAL = 3
    # Bound on held tokens whatever the tokenizer, so a degenerate output cannot make each step
    # re-decode a growing tail. Valid text reaches it only if 64 tokens in a row each end mid-character.
    MAX_HELD_TOKENS = 64
    # Ids before the window are dropped once this many have piled up (amortized: no copy per token).
    _TRIM_AT = 256

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True):
        """tokenizer: anything with a Hugging Face style decode(ids, skip_special_tokens=...)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        prompt = list(prompt_token_ids)
        self._ids = prompt[self._context_start(prompt) :]
        self._prefix = 0
        self._read = len(self._ids)
        self._boundaries: deque[int] = deque([0, self._read], maxlen=self.CONTEXT_TOKENS + 1)
        # A prompt that ends inside a character (token-id prompts can): leaving its U+FFFD out of the
        # sent text lets the output send that character once a generated token completes it.
        self._prefix_text = self._decode(self._ids).rstrip(REPLACEMENT)
        # Text already sent from the window past _prefix_text: characters that were complete before
        # the token holding them was (see _send_final_characters).
        self._sent = ""

    def push(self, token_ids: Iterable[int]) -> str:
        """Adds generated tokens; returns the text that is new and complete (possibly empty)."""
        pieces = []
        for token_id in token_ids:
            self._ids.append(int(token_id))
            pieces.append(self._step())
        return "".join(pieces)

    def flush(self) -> str:
        """Returns the text still held, at the end of generation. It may hold U+FFFD for bytes that
        never became a valid character."""
        if len(self._ids) == self._read:
            return ""
        return self._advance(len(self._ids), self._decode(self._ids[self._prefix :]))

    def _step(self) -> str:
        ids, n = self._ids, len(self._ids)
        text = self._decode(ids[self._prefix :])
        if not text.endswith(REPLACEMENT):
            return self._advance(n, text)
        sent_now = self._send_final_characters(text)
        unsent = text[len(self._prefix_text) + len(self._sent) :]
        partial = len(unsent) - len(unsent.rstrip(REPLACEMENT))
        held = n - self._read
        if partial <= self.MAX_PARTIAL and held <= self.MAX_HELD_TOKENS:
            return sent_now
        # Too much U+FFFD for an unfinished character: some of it is final. Cut where the text splits
        # cleanly, keeping the last MAX_PARTIAL tokens held in case they begin a valid character. A
        # few tries bound the cost; a byte run that never splits cleanly waits for MAX_HELD_TOKENS.
        for cut in range(n - self.MAX_PARTIAL, max(self._read, n - self.MAX_PARTIAL - 8), -1):
            head = self._decode(ids[self._prefix : cut])
            if head + self._decode(ids[cut:n]) == text:
                return sent_now + self._advance(cut, head)
        if held > self.MAX_HELD_TOKENS:
            cut = n - self.MAX_PARTIAL
            return sent_now + self._advance(cut, self._decode(ids[self._prefix : cut]))
        return sent_now

    def _send_final_characters(self, text: str) -> str:
        """Sends the characters before the window's trailing U+FFFD run, even mid-token.

        Later bytes can only change that run, so what precedes it is final. Without this, text would
        wait for a token boundary that falls between characters, and byte-level BPE trained on CJK
        text merges across characters often enough to hold several characters back.
        """
        final = text.rstrip(REPLACEMENT)
        sent = self._prefix_text + self._sent
        # startswith: a byte-fallback run can turn text already sent into U+FFFD until it completes.
        if len(final) > len(sent) and final.startswith(sent):
            self._sent = final[len(self._prefix_text) :]
            return final[len(sent) :]
        return ""

    def _advance(self, end: int, text: str) -> str:
        """Sends the window's text up to token `end` and makes `end` the new read position."""
        # Length-based diff, as TGI and vLLM do: for the decoders in use the window's text only ever
        # extends the text already sent, and where one does not this degrades to a garbled character
        # rather than repeated or lost text.
        sent = self._prefix_text + self._sent
        new_text = text[len(sent) :]
        # After a forced cut, characters already sent may lie past `end`; they stay counted as sent.
        self._sent = sent[len(text) :]
        self._boundaries.append(end)
        self._prefix = self._boundaries[0]
        self._read = end
        self._prefix_text = self._decode(self._ids[self._prefix : end])
        if self._prefix >= self._TRIM_AT:
            drop = self._prefix
            del self._ids[:drop]
            self._boundaries = deque((b - drop for b in self._boundaries), maxlen=self._boundaries.maxlen)
            self._prefix -= drop
            self._read -= drop
        return new_text

    def _context_start(self, prompt: list[int]) -> int:
        """Where to start decoding the prompt's tail: a few tokens back, at a character boundary."""
        n = len(prompt)
        if n <= self.CONTEXT_TOKENS:
            return 0
        # A cut inside a character shows as text that is not a suffix of a longer decode (a leading
        # U+FFFD, or a whole byte-fallback run turned to U+FFFD); step back until it is one.
        reference_start = max(0, n - self.CONTEXT_TOKENS - 8)
        reference = self._decode(prompt[reference_start:])
        for start in range(n - self.CONTEXT_TOKENS, reference_start, -1):
            if reference.endswith(self._decode(prompt[start:])):
                return start
        return 0

    def _decode(self, ids: Sequence[int]) -> str:
        # Spaces are never "cleaned up": that rewrites text across token boundaries, which would
        # make the window's text disagree with the text already sent.
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
