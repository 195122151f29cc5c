"""What a draft model's cache holds of the committed sequence.

A draft model drafts from its own KV cache, which holds a prefix of what it
reads of the committed sequence (its *view*), and during a round its own
drafts after it.  Each round it feeds only what the cache lacks: the tokens
committed since the last round.  A rejected tail is rolled back in O(1).

The view is the whole sequence, or, with a ``window``, a long prompt cut
short: its first ``sink`` tokens and its last ``window - sink``, then
everything generated after it.  The tokens in between are never fed.  So a
prompt of 2,000 tokens (a document to summarise or answer from) costs the
draft model a prefill of ``window`` tokens, not 2,000: on an AMD EPYC (AVX2,
2 threads) the 0.5B Qwen draft reads a prompt at about 250 tokens/s, so a
full view added 7 s to a RAG prompt the 1.5B target took 24 s to read.

A conversation's next turn starts with the last one's prompt and answer,
which the draft's cache already holds: :meth:`DraftContext.begin` keeps
the cache when the new prompt's view extends what it holds (the same
prompt start skipped as before) and that reads no more new tokens than a
fresh view would, so a chat's draft reads each turn's new message only.
A cache another drafter used in between is never kept (the decoder
remembers which context filled it).

Drafts stay lossless whatever the view: the target verifies every token.
A view changes only what the draft sees, and so how often it is right.
Positions in the draft's cache are contiguous, so the kept tail follows the
sink at the next position (relative positions within the tail are kept,
as RoPE attends by them); the first tokens stay because models attend
strongly to them (attention sinks, Xiao et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence
from weakref import WeakKeyDictionary

from forerun.decoding.draft_length import refine_seconds
from forerun.drafters.draft_window import SINK_TOKENS, window_problem
from forerun.errors import ConfigError
from forerun.protocol.decoder import Decoder
from forerun.protocol.token_sequences import common_prefix

#: what reading one committed token in a batch costs, as a share of a draft
#: step, before a read was timed: the 0.5B Qwen draft in q4-all reads a
#: prompt at about 250 tokens/s on 2 AVX2 cores and steps in about 20 ms
READ_PRIOR = 0.2

#: reads of at least this many tokens time what one token's read costs
TIMED_READ = 8

#: each draft decoder's last DraftContext: the one whose ``fed`` says what
#: the decoder's cache holds
_FILLED_BY: WeakKeyDictionary = WeakKeyDictionary()


class DraftContext:
    """A draft decoder's cache contents, as tokens of the view (see the
    module's text).  ``window``: the most prompt tokens the draft reads
    (``None``: all of them)."""

    def __init__(self, decoder: Decoder, window: int | None = None,
                 sink: int = SINK_TOKENS) -> None:
        problem = window_problem(window)
        if problem is not None or (window is not None and window <= sink):
            raise ConfigError(f"a draft window {problem or f'must be above {sink}'}, or None "
                              f"for the whole prompt; got {window!r}")
        self.decoder = decoder
        self.window = window
        self.sink = sink
        self.skipped = 0              # prompt tokens after the sink never fed
        self.fed: list[int] = []      # the cache's tokens, in order (the view's prefix,
        #                               then drafts)
        self._read_ema: float | None = None   # seconds to read one token, in a batch

    def begin(self, prompt_ids: Sequence[int], *, reuse: bool = True) -> None:
        """A new generation from ``prompt_ids``: the prompt's middle skipped
        if it is longer than the window, from an empty cache; or, with
        ``reuse``, the cache kept with the skip it was filled with, where
        the prompt's view so extends what the cache holds and reads no more
        new tokens than a fresh view would (see the module's text)."""
        n = len(prompt_ids)
        fresh = n - self.window if self.window is not None and n > self.window else 0
        if reuse and self._holds_cache() and self.skipped <= max(0, n - self.sink):
            kept = common_prefix(self.fed, self._view(prompt_ids, self.skipped))
            if kept > self.sink and n - self.skipped - kept <= n - fresh:
                return      # (catch_up rolls the cache back to what it shares)
        self.decoder.reset()
        self.fed = []
        self.skipped = fresh
        _FILLED_BY[self.decoder] = self

    def _holds_cache(self) -> bool:
        """Whether the decoder's cache holds what ``fed`` says: this context
        filled it last, and its length agrees."""
        return (_FILLED_BY.get(self.decoder) is self and bool(self.fed)
                and self.decoder.length == len(self.fed))

    def _view(self, sequence: Sequence[int], skipped: int) -> list[int]:
        if not skipped or len(sequence) < self.sink + skipped:
            return list(sequence)
        return list(sequence[:self.sink]) + list(sequence[self.sink + skipped:])

    def view(self, sequence: Sequence[int]) -> list[int]:
        """What the draft reads of ``sequence`` (the committed tokens)."""
        return self._view(sequence, self.skipped)

    def view_length(self, length: int) -> int:
        """The view's length for a sequence of ``length`` tokens."""
        if not self.skipped or length < self.sink + self.skipped:
            return length
        return length - self.skipped

    def catch_up(self, view: Sequence[int]) -> list[int]:
        """Roll the cache back to its longest common prefix with ``view``
        and return the tokens still to feed: at least the last one (fed
        again when the whole view is cached), whose logits the next draft
        needs."""
        n = common_prefix(self.fed, view)
        if n == len(view):
            n -= 1
        if n < len(self.fed):
            self.decoder.rollback(n)
            del self.fed[n:]
        return list(view[n:])

    def settle(self, committed_view: int) -> None:
        """Keep at most ``committed_view`` tokens (of the view) in the
        cache, never less than the decoder's committed length."""
        keep = min(committed_view, len(self.fed))
        if keep < len(self.fed):
            self.decoder.rollback(max(keep, self.decoder.committed_length))
            del self.fed[self.decoder.length:]

    # -- what reading costs ------------------------------------------------------
    def note_read(self, tokens: int, seconds: float) -> None:
        """A feed of ``tokens`` committed tokens took ``seconds``: a read of
        at least :data:`TIMED_READ` tokens refines the cost of one."""
        if tokens >= TIMED_READ:
            self._read_ema = refine_seconds(self._read_ema, seconds / tokens)

    def read_seconds(self, sequence: Sequence[int], rounds: int,
                     step_seconds: float) -> float:
        """What a round drafting after ``sequence`` should count for reading
        the committed tokens of its view the cache lacks, beyond the one a
        step reads (:class:`~forerun.decoding.drafter.ReadsContext`): their
        read spread over the generation's ``rounds`` so far (while drafting,
        a round leaves none to read: its step reads what it committed); a
        token at its timed cost, or at :data:`READ_PRIOR` draft steps of
        ``step_seconds`` before a read was timed."""
        view = self.view(sequence)
        missing = max(0, len(view) - common_prefix(self.fed, view) - 1)
        if not missing:
            return 0.0
        per_token = self._read_ema if self._read_ema is not None else \
            READ_PRIOR * step_seconds
        return per_token * missing / max(1, rounds)
