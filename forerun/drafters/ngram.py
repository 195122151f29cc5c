"""Prompt lookup: draft by copying what followed an earlier occurrence of the
most recent tokens.  No draft model; a lookup costs microseconds.

The index maps every n-gram of the sequence (for each ``n`` in
``min_n..max_n``) to the position of the token that followed its most recent
occurrence.  It is updated as tokens commit, never rebuilt by rescanning.

Choice of match: the longest ``n`` that matches wins, because a longer
context predicts the continuation more precisely; among occurrences of that
n-gram, the most recent wins, because text that repeats (code being edited,
a passage being summarised or quoted) tends to repeat its latest version.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import TokenSampler
from forerun.drafters.method_target import MethodOptions, MethodTarget, chain
from forerun.errors import ConfigError


class NgramIndex:
    """n-gram -> position of the token that followed its latest occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, indexing every n-gram that now has a follower."""
        seq = self.tokens
        for token in tokens:
            j = len(seq)          # position of the new token: it follows seq[j-n:j]
            for n, table in self._maps.items():
                if j >= n:
                    table[tuple(seq[j - n:j])] = j
            seq.append(int(token))

    def lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of
        the longest matching suffix; empty if no suffix matched."""
        seq = self.tokens
        end = len(seq)
        for n in range(self.max_n, self.min_n - 1, -1):
            if end < n:
                continue
            j = self._maps[n].get(tuple(seq[end - n:end]))
            if j is not None:
                return seq[j:min(j + k, end)]
        return []


class NgramDrafter:
    """A deterministic drafter over an :class:`NgramIndex` of the prompt and
    the generated text."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ConfigError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.index = NgramIndex(min_n, max_n)
        self._lookup_seconds = 0.0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.index = NgramIndex(self.min_n, self.max_n)
        self.index.extend(prompt_ids)

    def _sync(self, sequence: Sequence[int]) -> None:
        held = len(self.index.tokens)
        if held > len(sequence) or list(sequence[:held]) != self.index.tokens:
            # Not a continuation of what is indexed: start over.
            self.begin(sequence)
        else:
            self.index.extend(sequence[held:])

    def propose(self, sequence: Sequence[int], k: int, sampler: TokenSampler) -> Draft:
        start = time.perf_counter()
        self._sync(sequence)
        tokens = self.index.lookup(k) if k > 0 else []
        self._lookup_seconds = time.perf_counter() - start
        return Draft(tokens, None)

    def observe(self, sequence: Sequence[int], accepted: int) -> None:
        """Nothing to do: the next :meth:`propose` indexes the sequence."""

    def settle(self, length: int) -> None:
        pass  # the index only holds committed tokens; begin() resets it

    def step_seconds(self) -> float:
        return self._lookup_seconds


def build(target: MethodTarget, options: MethodOptions):
    """Prompt lookup's method (the registry's ``ngram``): chains it drafts."""
    return chain(target, NgramDrafter(), options)
