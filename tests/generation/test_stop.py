"""forerun.generation.stop: finding stop strings in streamed text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forerun.errors import GenerationConfigError
from forerun.generation.stop import StopStrings


def test_empty_stop_string_is_an_error():
    with pytest.raises(GenerationConfigError):
        StopStrings([""])
    with pytest.raises(GenerationConfigError):
        StopStrings(["ok", ""])


def test_single_string_and_non_strings_are_errors():
    with pytest.raises(GenerationConfigError, match="single string"):
        StopStrings("stop")
    with pytest.raises(GenerationConfigError):
        StopStrings(["ok", 3])


def test_no_stops():
    stops = StopStrings([])
    assert not stops
    assert stops.find("anything at all") is None
    assert stops.holdback("anything at all") == 0
    assert stops.holdback("") == 0


def test_find_earliest_of_several_stops():
    stops = StopStrings(["world", "lo", "xyz"])
    assert stops.find("hello world") == 3
    assert stops.find("say world, hello") == 4
    assert stops.find("nothing here") is None
    assert stops.find("") is None
    # the same stop twice: the first occurrence
    assert StopStrings(["ab"]).find("xxabyyab") == 2
    # duplicates are harmless
    assert StopStrings(["ab", "ab"]).find("xab") == 1


def test_find_nested_stop_that_completes_first_wins():
    # "c" is complete before "abcd" is, so generation stops at "c"
    stops = StopStrings(["abcd", "c"])
    assert stops.find("abcd") == 2
    # same end: the longer (earlier beginning) stop
    assert StopStrings(["d", "abcd"]).find("xabcd") == 1


def test_find_incremental_overlap():
    stops = StopStrings(["STOP", "\n\n"])
    text = "hello ST"
    assert stops.find(text) is None
    searched = len(text)
    text += "OP and more"
    # the match begins before `start` but ends after it: still found
    assert stops.find(text, start=searched) == 6
    # a match that ends strictly before `start` is not reported
    assert stops.find("STOP then", start=4) is None
    assert stops.find("STOP then", start=3) == 0
    # start past the end of the text
    assert stops.find("abc", start=10) is None
    # a two-char stop split across calls
    assert stops.find("line\n") is None
    assert stops.find("line\n\nnext", start=5) == 4


def test_holdback():
    stops = StopStrings(["</s>", "\n\nUser:"])
    assert stops.holdback("hello") == 0
    assert stops.holdback("hello <") == 1
    assert stops.holdback("hello </") == 2
    assert stops.holdback("hello </s") == 3
    assert stops.holdback("hello\n") == 1
    assert stops.holdback("hello\n\nUse") == 5
    assert stops.holdback("hello\n\nUser") == 6
    # the longest suffix counts, not the first found
    assert StopStrings(["aab", "ab"]).holdback("xaa") == 2
    # "ab" ends the text and may begin a new "abab" (find() reports the complete one)
    assert StopStrings(["abab"]).holdback("abab") == 2
    assert StopStrings(["abab"]).holdback("xaba") == 3
    # a text shorter than the prefix
    assert StopStrings(["abcdef"]).holdback("abc") == 3
    assert StopStrings(["abcdef"]).holdback("") == 0
    # a complete stop is not a *proper* prefix
    assert StopStrings(["ab"]).holdback("ab") == 0


def stream(stops: StopStrings, text: str, cuts: list[int]) -> str:
    """Feed ``text`` in chunks split at ``cuts`` the way a generation loop
    would, and return what it streams."""
    emitted = ""
    seen = ""
    bounds = sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    prev = 0
    for end in bounds:
        searched = len(seen)
        seen = text[:end]
        hit = stops.find(seen, start=searched)
        if hit is not None:
            assert hit >= len(emitted), "already streamed part of a stop string"
            return emitted + seen[len(emitted):hit]
        upto = len(seen) - stops.holdback(seen)
        assert upto >= len(emitted), "emitted text must only grow"
        emitted += seen[len(emitted):upto]
        prev = end
    assert prev == len(text)
    return seen  # generation ended without a stop: flush the holdback


def first_stop(stops: list[str], text: str) -> int | None:
    """Brute force: begin index of the first stop occurrence to complete."""
    best = None
    for s in stops:
        for i in range(len(text) - len(s) + 1):
            if text.startswith(s, i):
                key = (i + len(s), i)
                if best is None or key < best:
                    best = key
    return None if best is None else best[1]


ALPHABET = "ab\nc"


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=0, max_size=4),
    text=st.text(ALPHABET, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_streaming_yields_text_up_to_first_stop(stops, text, cuts):
    ss = StopStrings(stops)
    out = stream(ss, text, cuts)
    i = first_stop(stops, text)
    assert out == (text if i is None else text[:i])
    # and it matches the one-shot answer on the whole text
    assert ss.find(text) == i


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
    text=st.text(ALPHABET, max_size=30),
)
def test_holdback_is_longest_proper_prefix_suffix(stops, text):
    expected = 0
    for k in range(1, len(text) + 1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stops):
            expected = k
    assert StopStrings(stops).holdback(text) == expected


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
    text=st.text(ALPHABET, max_size=30),
    start=st.integers(0, 35),
)
def test_find_with_start_only_counts_matches_ending_after_it(stops, text, start):
    best = None
    for s in stops:
        for i in range(len(text) - len(s) + 1):
            if text.startswith(s, i) and i + len(s) - 1 >= start:
                key = (i + len(s), i)
                if best is None or key < best:
                    best = key
    assert StopStrings(stops).find(text, start) == (None if best is None else best[1])
