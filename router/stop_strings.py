"""Finds stop strings in streamed output text without ever sending a client part of one.

Text arrives in chunks (one detokenized token or more at a time), so a stop string can straddle
chunks. The matcher holds back the longest tail that could still grow into a stop string, and
releases it as soon as it cannot.

When several stop strings could match, the one that is complete first in the text wins (the earliest
end; at equal ends the earliest start). That is what generating one character at a time would do, so
the result does not depend on how the text was chunked.

Text fed with armed=False (the first min_tokens tokens' text) cannot end a match, as in vLLM: a stop string
may begin in it, but must end in armed text.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    def __init__(self, stops: Iterable[str], *, include_stop: bool = False):
        """include_stop: the text returned at a match ends after the stop string, not before it (vLLM's
        include_stop_str_in_output)."""
        self._stops = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._include_stop = include_stop
        if any(not s for s in self._stops):
            raise ValueError("stop strings must be non-empty")
        # Every proper prefix of a stop string: a tail equal to one of these must be held back.
        self._prefixes = {s[:i] for s in self._stops for i in range(1, len(s))}
        self._max_prefix = max((len(p) for p in self._prefixes), default=0)
        self._first_chars = {s[0] for s in self._stops}
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, new_text: str, armed: bool = True) -> tuple[str, bool]:
        """Returns (text safe to send now, whether a stop string was found). armed=False: no match may
        end in new_text (it is still kept as the start of a later one).

        After a stop, the text before it is returned once and every later call returns ("", True).
        """
        if self._stopped:
            return "", True
        if not self._stops:
            return new_text, False
        held = self._held
        text = held + new_text
        best: tuple[int, int] | None = None  # (end, start) of the first complete stop string
        for stop in self._stops if armed else ():
            # A match must end inside the new text: the held tail holds none that may count (it was
            # searched when it came, or came unarmed).
            start = text.find(stop, max(0, len(held) - len(stop) + 1))
            if start >= 0:
                match = (start + len(stop), start)
                if best is None or match < best:
                    best, self.matched = match, stop
        if best is not None:
            self._stopped = True
            self._held = ""
            return text[: best[0] if self._include_stop else best[1]], True
        keep = self._held_tail_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Returns the held-back text when generation ended for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _held_tail_length(self, text: str) -> int:
        # Longest first: the earliest position from which the rest could still become a stop string.
        # The first-character test skips the slice-and-hash for almost every position.
        n = len(text)
        for length in range(min(self._max_prefix, n), 0, -1):
            if text[n - length] in self._first_chars and text[n - length :] in self._prefixes:
                return length
        return 0
