"""The grouping probe asked about another thread count: verifications on
``threads`` threads against plain decoding on the decoder's own count (what
asynchronous drafting needs before it gives the target part of the cores)."""

from __future__ import annotations

import torch

from forerun.protocol.grouping_probe import GroupingResult, exact_group_size
from table_decoders import TableDecoder

V = 8
TABLE = torch.randn(3, V, V, generator=torch.Generator().manual_seed(0))
TOKENS = [int(t) for t in torch.randint(0, V, (80,), generator=torch.Generator().manual_seed(1))]


class ThreadSensitive(TableDecoder):
    """A table model on 2 threads whose forwards of ``from_size`` or more
    positions come out ``shift`` higher on any other thread count."""

    def __init__(self, from_size: int | None, shift: float = 1e-3) -> None:
        super().__init__(TABLE)
        self.from_size, self.shift = from_size, shift
        self.threads = 2

    def set_threads(self, n: int) -> None:
        self.threads = n

    def feed(self, tokens, *, last_only=False, return_hidden=False):
        out = super().feed(tokens, last_only=last_only, return_hidden=return_hidden)
        if self.threads != 2 and self.from_size is not None and len(tokens) >= self.from_size:
            out.logits += self.shift
        return out


def probe(decoder, threads):
    return exact_group_size(decoder, TOKENS, contexts=(5, 40), threads=threads)


def test_a_thread_count_that_changes_nothing_keeps_every_group():
    result = probe(ThreadSensitive(None), threads=1)
    assert (result.exact_group, result.first_inexact) == (16, None)


def test_a_thread_count_that_changes_one_position_allows_no_verification():
    decoder = ThreadSensitive(1)
    result = probe(decoder, threads=1)
    assert (result.exact_group, result.first_inexact) == (0, 1)
    assert abs(result.max_difference - 1e-3) < 1e-6
    assert decoder.threads == 2 and decoder.length == 0       # set back, reset
    assert GroupingResult.from_dict(result.to_dict()) == result
    assert "no verification on it is exact" in result.describe()


def test_groups_that_differ_from_some_size_on_it_cap_the_group():
    result = probe(ThreadSensitive(4), threads=1)
    assert (result.exact_group, result.first_inexact) == (3, 4)


def test_without_threads_one_position_is_not_probed():
    """The classic probe compares groups of 2 and more with one-by-one
    forwards on the same count: a model that differs on other counts is
    exact there."""
    result = exact_group_size(ThreadSensitive(1), TOKENS, contexts=(5, 40))
    assert (result.exact_group, result.first_inexact) == (16, None)
