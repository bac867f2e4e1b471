"""One request's output text (router/text_stream.py) as vLLM makes it: the stop token's text is left out
unless include_stop_str_in_output, stop strings cannot end within the first min_tokens tokens, a matched
stop string stays in the text with include_stop_str_in_output, and logprobs get their tokens' texts."""

from __future__ import annotations

import pytest

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.off_loop import OffLoop
from router.text_stream import TextStream

WORDS = {0: "<eos>", 1: "a", 2: "b", 3: "c", 4: ".", 5: " ", 6: "STOP"}
SPECIAL = {0}
EOS, LENGTH = pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH


class CharTokenizer:
    """Token i is WORDS[i]; 0 is a special token (EOS)."""

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        return "".join(WORDS[i] for i in ids if not (skip_special_tokens and i in SPECIAL))

    def decode_each(self, ids):
        return [WORDS[i] for i in ids]


def run(tokens, finish=LENGTH, per_step=1, **options) -> tuple[str, bool]:
    """The whole text of `tokens` fed per_step at a time, the last step with `finish`."""
    stream = TextStream(CharTokenizer(), [1], **options)
    text, stopped = "", False
    steps = [tokens[i : i + per_step] for i in range(0, len(tokens), per_step)]
    for i, step in enumerate(steps):
        piece, stopped = stream.step(step, finish if i == len(steps) - 1 else 0)
        text += piece
        if stopped:
            break
    return text, stopped


@pytest.mark.parametrize("per_step", [1, 3])
def test_the_stop_tokens_text_is_dropped_and_kept_with_include_stop_str_in_output(per_step):
    # "." (4) as a stop_token_id: the scheduler ends with FINISH_REASON_EOS after it.
    assert run([1, 2, 4], EOS, per_step) == ("ab", False)
    assert run([1, 2, 4], EOS, per_step, include_stop_str_in_output=True) == ("ab.", False)
    # A special EOS is skipped either way, unless special tokens are kept.
    assert run([1, 0], EOS, per_step, include_stop_str_in_output=True) == ("a", False)
    assert run([1, 0], EOS, per_step, include_stop_str_in_output=True, skip_special_tokens=False) == (
        "a<eos>",
        False,
    )
    assert run([1, 4], LENGTH, per_step) == ("a.", False)  # a length stop keeps every token's text


def test_stop_strings_end_the_text_before_the_match_or_after_it():
    assert run([1, 2, 3, 1], stop=["bc"]) == ("a", True)
    assert run([1, 2, 3, 1], stop=["bc"], include_stop_str_in_output=True) == ("abc", True)
    assert run([1, 6, 1], stop=["STOP"], per_step=3) == ("a", True)


def test_no_stop_string_ends_within_the_first_min_tokens_tokens():
    # "b" is token 2: with min_tokens=2 the first "b" cannot stop; the second can.
    assert run([2, 1, 2, 3], stop=["b"], min_tokens=2) == ("ba", True)
    assert run([2, 1, 2, 3], stop=["b"], min_tokens=2, per_step=4) == ("ba", True)
    # A match that begins in those tokens but ends after them counts (vLLM: it must end in new text).
    assert run([1, 2, 3], stop=["bc"], min_tokens=2) == ("a", True)
    assert run([1, 2, 3], stop=["ab"], min_tokens=2) == ("abc", False)


def test_logprobs_get_each_tokens_text():
    stream = TextStream(CharTokenizer(), [1])
    lp = pb.Logprobs(chosen=pb.TokenLogprob(token_id=2), top=[pb.TokenLogprob(token_id=3)])
    assert stream.step([2], 0, [lp]) == ("b", False)
    assert (lp.chosen.text, lp.top[0].text) == ("b", "c")


def test_off_loop_batches_jobs_and_hands_each_failure_to_its_own_awaiter():
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    def fail():
        raise ValueError("only mine")

    async def main():
        off = OffLoop(ThreadPoolExecutor(1))
        results = await asyncio.gather(
            *(off.run(pow, i, 2) for i in range(10)), off.run(fail), return_exceptions=True
        )
        return results, off.batches

    results, batches = asyncio.run(main())
    assert results[:10] == [i * i for i in range(10)] and isinstance(results[10], ValueError)
    assert batches == 1  # submitted in one loop iteration: one hand-off
