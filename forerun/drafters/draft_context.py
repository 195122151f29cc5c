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

Drafts stay lossless whatever the view: the target verifies every token.
A view changes only what the draft sees, and so how often it is right.
Positions in the draft's cache are contiguous, so the kept tail follows the
sink at the next position (relative positions within the tail are kept,
as RoPE attends by them); the first tokens stay because models attend
strongly to them (attention sinks, Xiao et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence

from forerun.errors import ConfigError
from forerun.protocol.decoder import Decoder
from forerun.protocol.token_sequences import common_prefix

#: tokens of a long prompt's start a window keeps
SINK_TOKENS = 4


class DraftContext:
    """A draft decoder's cache contents, as tokens of the view (see the
    module's text).  ``window``: the most prompt tokens the draft reads
    (``None``: all of them)."""

    def __init__(self, decoder: Decoder, window: int | None = None,
                 sink: int = SINK_TOKENS) -> None:
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window <= sink):
            raise ConfigError(f"a draft window must be an integer above {sink} (the tokens "
                              f"it keeps of a prompt's start), or None for the whole "
                              f"prompt; got {window!r}")
        self.decoder = decoder
        self.window = window
        self.sink = sink
        self.skipped = 0              # prompt tokens after the sink never fed
        self.fed: list[int] = []      # the cache's tokens, in order (the view's prefix,
        #                               then drafts)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """A new generation from ``prompt_ids``: an empty cache, and the
        prompt's middle skipped if it is longer than the window."""
        self.decoder.reset()
        self.fed = []
        n = len(prompt_ids)
        self.skipped = n - self.window if self.window is not None and n > self.window else 0

    def view(self, sequence: Sequence[int]) -> list[int]:
        """What the draft reads of ``sequence`` (the committed tokens)."""
        if not self.skipped or len(sequence) < self.sink + self.skipped:
            return list(sequence)
        return list(sequence[:self.sink]) + list(sequence[self.sink + self.skipped:])

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
