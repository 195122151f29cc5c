"""The suffix store: its longest match against a brute-force search, what it
forgets when full, its fixed memory, and its use from several threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forerun.drafters.suffix_store import CANDIDATES, LONGEST, SuffixStore
from forerun.errors import ConfigError


def brute_force(documents, context, most):
    """The longest match of ``context``'s last tokens before some position of
    some document that a token follows (at least 2 tokens, at most LONGEST),
    the latest among equals, and up to ``most`` tokens from that position
    to its document's end."""
    best, found = 0, []
    for doc in documents:
        for p in range(1, len(doc)):
            length = 0
            while (length < min(LONGEST, len(context), p)
                   and doc[p - 1 - length] == context[-1 - length]):
                length += 1
            if length >= 2 and length >= best:
                best, found = length, doc[p:p + most]
    return best, found


@settings(max_examples=300, deadline=None)
@given(documents=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1,
                          max_size=3),
       context=st.lists(st.integers(0, 3), min_size=0, max_size=12), most=st.integers(1, 6))
def test_recorded_documents_match_brute_force(documents, context, most):
    # (fewer than CANDIDATES tokens in all: every occurrence is a candidate)
    assert sum(map(len, documents)) < CANDIDATES
    store = SuffixStore(1024)
    for doc in documents:
        store.record(doc)
    stored = list({tuple(d): None for d in documents})   # (a repeat is stored once)
    length, tokens = store.find(context, most)
    assert (length, tokens) == brute_force([list(d) for d in stored], context, most)


@settings(max_examples=200, deadline=None)
@given(sequence=st.lists(st.integers(0, 3), min_size=1, max_size=30),
       chunks=st.lists(st.integers(1, 8), max_size=8), most=st.integers(1, 6))
def test_growing_document_matches_brute_force(sequence, chunks, most):
    """A generation's own store: the sequence so far, grown in pieces, and
    searched with itself as the context (prompt lookup)."""
    store = SuffixStore(64, grow=True)
    store.open()
    held = 0
    for size in chunks + [len(sequence)]:
        store.extend(sequence[held:held + size])
        held = min(len(sequence), held + size)
        assert store.open_length == held
        length, tokens = store.find(sequence[:held], most)
        assert (length, tokens) == brute_force([sequence[:held]], sequence[:held], most)
        if held == len(sequence):
            break


def test_longest_match_wins_then_the_latest():
    store = SuffixStore(1024)
    store.record([1, 2, 3, 4, 50])
    store.record([9, 3, 4, 60])
    store.record([8, 3, 4, 70])
    assert store.find([1, 2, 3, 4], 3) == (4, [50])   # longest
    assert store.find([7, 3, 4], 3) == (2, [70])      # latest of equals
    assert store.find([7, 7], 3) == (0, [])


def test_a_long_answer_start_is_told_apart_by_its_prompt():
    """Every chat prompt ends alike: the order-12 index finds the request
    whose text before that ending matches, not just the latest request."""
    header = [90, 91, 92, 93, 94]
    store = SuffixStore(4096)
    store.record([1, 2, 3, 4, 5, 6, 7, 8] + header + [500, 501, 502])
    for i in range(200):       # 200 later requests ending with the same header
        store.record([100 + i, 101 + i, 102 + i, 103 + i, 104 + i, 105 + i, 106 + i]
                     + header + [600 + i])
    length, tokens = store.find([0, 1, 2, 3, 4, 5, 6, 7, 8] + header, 3)
    assert tokens == [500, 501, 502] and length == 13


def test_full_store_forgets_the_oldest_and_keeps_its_memory():
    store = SuffixStore(64)
    size = store.nbytes
    store.record([1, 2, 3, 4, 5])
    assert store.find([1, 2, 3], 2) == (3, [4, 5])
    for i in range(40):
        store.record([200 + 3 * i, 201 + 3 * i, 202 + 3 * i])
    assert len(store) == 64 and store.nbytes == size
    assert store.find([1, 2, 3], 2) == (0, [])                # forgotten
    assert store.find([317, 318], 2) == (2, [319])            # the latest kept
    # a document longer than the store keeps its end
    store.record(list(range(1000, 1200)))
    assert store.find([1100, 1101], 2) == (0, [])
    assert store.find([1190, 1191], 2) == (2, [1192, 1193])


def test_a_match_stops_at_the_oldest_slot_and_between_documents():
    store = SuffixStore(64)
    store.record([5, 6, 7])
    store.record([8, 5, 6, 9])
    # [5, 6] before 9 matches 2 tokens: the 8 before it is not the 7 of the
    # first document, whose end the separator closes
    assert store.find([4, 5, 6], 3) == (2, [9])
    assert store.find([6, 7], 3) == (0, [])    # the end of a document: nothing follows


def test_the_same_document_is_stored_once_and_clear_forgets():
    store = SuffixStore(1024)
    assert store.record([1, 2, 3, 4])
    used = len(store)
    assert not store.record([1, 2, 3, 4])
    assert len(store) == used
    store.clear()
    assert len(store) == 0 and store.find([1, 2, 3], 2) == (0, [])
    assert store.record([1, 2, 3, 4])


@pytest.mark.parametrize("capacity", [0, 63, 2.5, True, "1k"])
def test_bad_capacity(capacity):
    with pytest.raises(ConfigError, match="capacity"):
        SuffixStore(capacity)


def test_threads_read_only_what_was_written():
    """Four threads record and search at once, each in tokens of its own:
    a draft is always a real continuation in that thread's documents (a
    read torn by another thread's write would mix them)."""
    store = SuffixStore(1 << 12)
    errors: list[str] = []
    start = threading.Barrier(4)

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        base = 1000 * (t + 1)
        documents = []
        start.wait()
        for _ in range(300):
            doc = (base + rng.integers(0, 6, size=int(rng.integers(4, 20)))).tolist()
            store.record(doc)
            documents.append(doc)
            context = (base + rng.integers(0, 6, size=6)).tolist()
            length, tokens = store.find(context, 4)
            if not tokens:
                continue
            if any(not base <= x < base + 6 for x in tokens):
                errors.append(f"thread {t} drafted another thread's tokens {tokens}")
                continue
            if not any(doc[p - length:p] == context[-length:] and doc[p:p + 4] == tokens
                       for doc in documents for p in range(length, len(doc))):
                errors.append(f"thread {t}: {tokens} follows no match of {context}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
