"""One request's output text: generated token ids in, the text a client may see out.

It puts together what decides the text of each streamed message, in vLLM's order: incremental
detokenization (router/detokenizer.py), the stop token's text left out, stop strings (armed only after
min_tokens tokens), and the text of each logprob's tokens. Every call decodes, so the Frontend runs it off
the event loop (router/off_loop.py); a TextStream is used by one request at a time and holds no lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.pb.tpserve.v1 import generation_pb2
from router.detokenizer import IncrementalDetokenizer
from router.stop_strings import StopStringMatcher

FINISH_EOS = generation_pb2.FINISH_REASON_EOS


class TextStream:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        """tokenizer: router/tokenizer.py's Tokenizer (decode and decode_each)."""
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._stops = StopStringMatcher(stop, include_stop=include_stop_str_in_output) if stop else None
        self._min_tokens = min_tokens
        self._include_stop_token = include_stop_str_in_output
        self._num_tokens = 0

    def step(
        self, token_ids: Sequence[int], finish_reason: int, logprobs: Sequence[generation_pb2.Logprobs] = ()
    ) -> tuple[str, bool]:
        """The text new with these tokens, and whether a stop string ended it. finish_reason: the
        scheduler's (EOS: the last token is EOS or one of stop_token_ids). logprobs get their texts."""
        ids = list(token_ids)
        if finish_reason == FINISH_EOS and ids and not self._include_stop_token:
            # As vLLM: the token that stopped generation is counted, but its text is not the answer's.
            ids = ids[:-1]
        # Tokens up to min_tokens cannot end a stop string; split the text where they end.
        unarmed = max(0, min(len(ids), self._min_tokens - self._num_tokens))
        self._num_tokens += len(token_ids)
        pieces = [(self._detok.push(ids[:unarmed]), False), (self._detok.push(ids[unarmed:]), True)]
        if finish_reason:
            pieces.append((self._detok.flush(), True))
        text, stopped = "", False
        for piece, armed in pieces:
            if self._stops is None:
                text += piece
                continue
            sent, stopped = self._stops.feed(piece, armed)
            text += sent
            if stopped:
                break
        if finish_reason and not stopped and self._stops is not None:
            text += self._stops.flush()
        self.fill_logprob_texts(logprobs)
        return text, stopped

    @property
    def matched_stop(self) -> str:
        """The stop string that ended the text ("" if none did)."""
        return (self._stops.matched if self._stops is not None else None) or ""

    def fill_logprob_texts(self, logprobs: Sequence[generation_pb2.Logprobs]) -> None:
        """Each alternative's text, its token decoded alone: one batched decode for the whole message."""
        if not logprobs:
            return
        entries = [t for lp in logprobs for t in (lp.chosen, *lp.top)]
        for entry, text in zip(
            entries, self._tokenizer.decode_each([t.token_id for t in entries]), strict=True
        ):
            entry.text = text
