"""Token counts over local text: each distinct file once, a byte budget,
a seeded order, and the frequency order a draft vocabulary is cut from."""

from __future__ import annotations

import numpy as np

from forerun.corpus.token_frequency import count_tokens, frequency_order, seeded_order


def _encode(texts):
    """Characters as token ids (a..z: 0..25)."""
    return [[ord(c) - ord("a") for c in t if c.isalpha()] for t in texts]


def test_counts_each_distinct_text_once_up_to_the_budget(tmp_path):
    files = []
    for name, text in (("a.txt", "aab"), ("b.txt", "aab"), ("c.txt", "cc"), ("d.txt", "zzzz")):
        (tmp_path / name).write_text(text)
        files.append(tmp_path / name)
    counts, read = count_tokens(_encode, 26, files, budget=6)
    # b.txt repeats a.txt; after c.txt 5 bytes are read, d.txt still fits
    # the budget's start, then reading stops.
    assert read == {"files": 3, "bytes": 9, "tokens": 9}
    assert counts[0] == 2 and counts[1] == 1 and counts[2] == 2 and counts[25] == 4
    counts, read = count_tokens(_encode, 26, files, budget=5)
    assert read["files"] == 2 and counts[25] == 0


def test_the_order_puts_required_ids_first_then_by_count_then_by_id():
    counts = np.array([5, 0, 9, 5, 1])
    assert frequency_order(counts, first=[4]) == [4, 2, 0, 3, 1]
    assert frequency_order(counts) == [2, 0, 3, 4, 1]


def test_a_seeded_order_is_the_same_for_the_same_seed_and_mixes_folders(tmp_path):
    files = [tmp_path / f"{d}/{n}.py" for d in "abc" for n in range(5)]
    one, again, other = seeded_order(files, 0), seeded_order(files, 0), seeded_order(files, 1)
    assert one == again and one != other and sorted(one) == sorted(files)
    assert one[:5] != files[:5]         # not the alphabet's first folder first
