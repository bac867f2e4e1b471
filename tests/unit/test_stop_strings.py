import random

import pytest

from router.stop_strings import StopStringMatcher


def run(stops, chunks):
    """Feeds chunks until a stop; returns (everything sent, stopped), flushing if never stopped."""
    m = StopStringMatcher(stops)
    sent = []
    for chunk in chunks:
        emit, stopped = m.feed(chunk)
        sent.append(emit)
        if stopped:
            return "".join(sent), True
    sent.append(m.flush())
    return "".join(sent), False


def reference(stops, text):
    """Character at a time, the way a server generating one character per step would stop."""
    for end in range(1, len(text) + 1):
        hits = [end - len(s) for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: min(hits)], True
    return text, False


def test_no_stops_passes_everything_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_stop_inside_one_chunk():
    m = StopStringMatcher(["END"])
    assert m.feed("hello END world") == ("hello ", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_across_chunk_boundaries():
    m = StopStringMatcher(["<|stop|>"])
    assert m.feed("Hi <|") == ("Hi ", False)
    assert m.feed("st") == ("", False)
    assert m.feed("op|") == ("", False)
    assert m.feed(">tail") == ("", True)


def test_held_text_released_when_it_cannot_become_a_stop():
    m = StopStringMatcher(["abc"])
    assert m.feed("xa") == ("x", False)
    assert m.feed("b") == ("", False)
    assert m.feed("d") == ("abd", False)
    assert m.feed("ab") == ("", False)
    assert m.flush() == "ab"
    assert m.flush() == ""


def test_overlapping_prefixes():
    # "ab" completes first whatever the chunking, so "abc" never gets the chance.
    assert run(["ab", "abc"], ["xa", "bc"]) == ("x", True)
    assert run(["abc", "ab"], ["xabc"]) == ("x", True)
    # A longer stop that only shares a prefix: "abd" fails at "c", then "bc" is not a stop either.
    assert run(["abd", "c"], ["ab", "c"]) == ("ab", True)
    # Self-overlapping stop: "aab" must still be found in "aaab" across chunks.
    assert run(["aab"], ["a", "a", "a", "b"]) == ("a", True)


def test_first_completed_stop_wins_over_an_earlier_starting_one():
    assert run(["abcde", "bc"], ["abcde"]) == ("a", True)
    assert run(["abcde", "bc"], list("abcde")) == ("a", True)


def test_multiple_stops():
    assert run(["\n\n", "###", "User:"], ["Answer: 42", "\nUs", "er: more"]) == ("Answer: 42\n", True)
    assert run(["\n\n", "###"], ["a#", "#b"]) == ("a##b", False)


def test_stop_at_very_start():
    assert run(["ab"], ["ab"]) == ("", True)
    assert run(["ab"], ["a", "bxyz"]) == ("", True)
    m = StopStringMatcher(["a"])
    assert m.feed("a") == ("", True)


def test_stop_string_never_sent_and_empty_chunks_are_fine():
    m = StopStringMatcher(["STOP"])
    assert m.feed("") == ("", False)
    assert m.feed("S") == ("", False)
    assert m.feed("") == ("", False)
    assert m.feed("TOP") == ("", True)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_unicode_stops():
    assert run(["日本"], ["こんにちは日", "本語"]) == ("こんにちは", True)
    assert run(["🙂"], ["hi ", "🙂"]) == ("hi ", True)


def test_any_chunking_matches_one_character_at_a_time():
    rng = random.Random(0)
    alphabet = "ab c\n"
    for _ in range(3000):
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert run(stops, chunks) == reference(stops, text), (stops, chunks)


def test_held_back_text_is_bounded_by_the_longest_stop():
    m = StopStringMatcher(["abcdef"])
    sent = []
    for _ in range(100):
        emit, stopped = m.feed("abcde")
        assert not stopped
        sent.append(emit)
        assert len("".join(sent)) >= 5 * len(sent) - 5
    assert "".join(sent) + m.flush() == "abcde" * 100
