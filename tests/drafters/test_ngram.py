"""Prompt-lookup drafting: the incremental index against a brute-force
search, and the drafter's behaviour."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.drafters.ngram import NgramDrafter, NgramIndex
from forerun.errors import ConfigError


def brute_force(seq, k, min_n, max_n):
    """Longest suffix n-gram with an earlier occurrence; its latest one."""
    end = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if end < n:
            continue
        suffix = seq[end - n:]
        for j in range(end - 1, n - 1, -1):       # j: position after an occurrence
            if seq[j - n:j] == suffix:
                return seq[j:min(j + k, end)]
    return []


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 4), max_size=60),
       chunks=st.lists(st.integers(1, 7), max_size=20),
       k=st.integers(1, 8), min_n=st.integers(1, 3), extra=st.integers(0, 2))
def test_incremental_index_matches_brute_force(seq, chunks, k, min_n, extra):
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    pos = 0
    for size in chunks + [len(seq)]:
        index.extend(seq[pos:pos + size])
        pos = min(len(seq), pos + size)
        assert index.lookup(k) == brute_force(seq[:pos], k, min_n, max_n)
        if pos == len(seq):
            break


def test_prefers_longest_then_most_recent():
    index = NgramIndex(1, 3)
    #            0  1  2  3  4  5  6  7  8  9
    index.extend([1, 2, 3, 9, 2, 3, 8, 5, 2, 3])
    # Suffix (2, 3): latest earlier occurrence is at 4..5, followed by 8.
    assert index.lookup(2) == [8, 5]
    index.extend([8])
    # Suffix (2, 3, 8) now matches 4..6 exactly: followed by 5, 2, 3, 8.
    assert index.lookup(4) == [5, 2, 3, 8]


def test_no_match_proposes_nothing():
    drafter = NgramDrafter(2, 3)
    drafter.begin([1, 2, 3, 4])
    sampler = TokenSampler(SamplingParams(), 0)
    assert drafter.propose([1, 2, 3, 4], 5, sampler).tokens == []
    draft = drafter.propose([1, 2, 3, 4, 1, 2], 5, sampler)
    assert draft.tokens == [3, 4, 1, 2] and draft.probs is None


def test_restarts_when_sequence_is_not_a_continuation():
    drafter = NgramDrafter(1, 2)
    sampler = TokenSampler(SamplingParams(), 0)
    drafter.begin([5, 6, 7, 5])
    assert drafter.propose([5, 6, 7, 5], 2, sampler).tokens == [6, 7]
    assert drafter.propose([1, 2, 1], 2, sampler).tokens == [2, 1]


def test_bad_sizes():
    with pytest.raises(ConfigError, match="min_n"):
        NgramDrafter(3, 2)
    with pytest.raises(ConfigError):
        NgramDrafter(0, 2)
