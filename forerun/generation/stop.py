"""Stop strings for streamed generation.

A streaming loop decodes the text generated so far after each step and asks

* :meth:`StopStrings.find` whether a stop string has appeared, searching only
  the newly decoded tail (matches that end in it), and
* :meth:`StopStrings.holdback` how many trailing characters it must not emit
  yet, because a stop string may still complete there.

Emitting ``text[:len(text) - holdback(text)]`` each step, and
``text[:find(...)]`` once a stop is found, streams exactly
``text[:i]`` where ``i`` is where the first stop string to *complete* begins,
however the text was split into steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from forerun.errors import GenerationConfigError

__all__ = ["StopStrings"]


class StopStrings:
    """A set of stop strings.

    "The first stop" is the stop occurrence that is complete first while the
    text grows, that is the one that *ends* earliest; among occurrences ending
    at the same place, the one that begins earliest (the longest).  It is also
    the one that begins earliest, except when one stop occurs strictly inside
    another's occurrence (stops ``"abcd"`` and ``"c"`` in ``"abcd"``): then the
    inner one wins, as generation stops as soon as it has been produced.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise GenerationConfigError(
                f"stop strings must be a list of strings, got the single string {stops!r}; "
                f"pass [{stops!r}]")
        stops = tuple(stops)
        for s in stops:
            if not isinstance(s, str):
                raise GenerationConfigError(f"stop strings must be strings, got {s!r}")
            if not s:
                raise GenerationConfigError("stop strings must not be empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))  # dedupe, keep order
        # every proper prefix (non-empty) of every stop, for holdback
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._max_prefix = max((len(s) - 1 for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def __len__(self) -> int:
        return len(self.stops)

    def __repr__(self) -> str:
        return f"StopStrings({list(self.stops)!r})"

    def find(self, text: str, start: int = 0) -> int | None:
        """Where in ``text`` the first stop string begins, or ``None``.

        Only occurrences whose last character is at index ``>= start`` count,
        so a caller that has already searched ``text[:n]`` can pass
        ``start=n`` after ``text`` grew: occurrences straddling ``n`` are still
        found.  Among the occurrences counted, the one ending earliest wins
        (ties: the one beginning earliest); see the class docstring.
        """
        start = max(0, start)
        best: tuple[int, int] | None = None  # (end, begin)
        for s in self.stops:
            i = text.find(s, max(0, start - len(s) + 1))
            if i >= 0:
                candidate = (i + len(s), i)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else best[1]

    def holdback(self, text: str) -> int:
        """The length of the longest suffix of ``text`` that is a proper prefix
        of some stop string (0 when there is none, or no stops).  Those
        characters must not be streamed yet."""
        for k in range(min(len(text), self._max_prefix), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
