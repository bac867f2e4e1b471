"""N-gram prompt lookup (vLLM's "ngram" speculative method): proposes what followed the last time the
sequence's last n tokens appeared in its own prompt or output, for n from prompt_lookup_max down to
prompt_lookup_min (the longest suffix that occurred before wins; of its occurrences, the latest).

It pays where a model copies: a request that quotes and edits its prompt, code completion over a long
file, a summary that reuses phrases. It needs no model and runs where the tokens are, in the scheduler.

The lookup is incremental. Each sequence keeps one dict per n from every n-gram it contains to the
position right after that n-gram's latest occurrence, and a call only adds the n-grams that end at the
tokens appended since the last call; a proposal is then one dict lookup per n. So a call costs a few
microseconds whatever the sequence's length, and only the first call pays for indexing the prompt
(bench/speculative.py measures both). Plain Python: no torch, no gRPC.
"""

from __future__ import annotations


class NgramIndex:
    """One sequence's n-grams. Its tokens only grow (a rolled-back proposal never became a token)."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.sizes = range(max_n, min_n - 1, -1)  # longest first: the longest match is the surest
        # _after[n][ngram]: the position after the latest occurrence of ngram (n tokens) so far.
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        # Positions p < _indexed have their n-grams tokens[p - n : p] in the tables.
        self._indexed = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of tokens
        found; [] when none occurred before."""
        end = len(tokens)
        # Every n-gram that ends before the last token: the suffix itself (ending at `end`) must not be
        # in the tables when it is looked up, or it would find itself.
        for p in range(self._indexed, end):
            for n, table in self._after.items():
                if p >= n:
                    table[tuple(tokens[p - n : p])] = p
        self._indexed = max(self._indexed, end)
        for n in self.sizes:
            if end > n:
                at = self._after[n].get(tuple(tokens[end - n :]))
                if at is not None:
                    return _copy(tokens, at, k)
        return []


def _copy(tokens: list[int], at: int, k: int) -> list[int]:
    """k tokens from position `at` on, where the copy may run past the end into itself (as an LZ77 copy
    does): a match `end - at` tokens back predicts a text that repeats with that period, so a sequence
    caught in a loop gets k proposals, not only the few before its end."""
    out = tokens[at : at + k]
    end = len(tokens)
    for i in range(at + len(out), at + k):
        out.append(out[i - end])
    return out
