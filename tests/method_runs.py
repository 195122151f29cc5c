"""Running a decoding method directly (without the generation runner), as
the runner does: take the tokens its rounds yield, stop, settle."""

from __future__ import annotations

from collections.abc import Sequence

from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.stats import GenerationStats


def run_method(method, prompt: Sequence[int], n: int, sampler: TokenSampler,
               stats: GenerationStats) -> list[int]:
    """The first ``n`` tokens ``method`` generates after ``prompt``; the
    method is then settled at ``len(prompt) + n`` positions."""
    out: list[int] = []
    rounds = method.run(list(prompt), sampler, stats)
    for tokens in rounds:
        out += tokens
        if len(out) >= n:
            break
    rounds.close()
    method.settle(len(prompt) + n)
    return out[:n]


def greedy_tokens(method, prompt: Sequence[int], n: int,
                  stats: GenerationStats | None = None) -> list[int]:
    """:func:`run_method` with greedy decoding."""
    return run_method(method, prompt, n, TokenSampler(SamplingParams(), seed=0),
                      stats if stats is not None else GenerationStats())


class FeedLog:
    """A Decoder that records ``(len(tokens), last_only)`` of each feed it
    passes on to ``inner`` (anything else goes to ``inner`` unrecorded)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.feeds: list[tuple[int, bool]] = []

    def feed(self, tokens, *, last_only=False, return_hidden=False):
        self.feeds.append((len(tokens), last_only))
        return self.inner.feed(tokens, last_only=last_only, return_hidden=return_hidden)

    def __getattr__(self, name):
        return getattr(self.inner, name)
