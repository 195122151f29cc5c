"""A small draft model that shares the target's tokenizer."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..decoder import Decoder
from ..decoding.draft_length import refine_seconds
from ..sampling import TokenSampler
from .base import Draft


class DraftModelDrafter:
    """Drafts autoregressively with its own Decoder.

    Its cache always holds a prefix of the committed sequence (plus, during a
    round, its own drafts); each proposal first feeds the committed tokens it
    lacks, then drafts.  After verification nothing is re-fed that the cache
    already holds: a rejected tail is rolled back in O(1).
    """

    name = "draft"

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self._fed: list[int] = []     # tokens held in the draft cache, in order
        self._known_committed = 0     # length of the last committed sequence seen
        self._step_ema: float | None = None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.decoder.reset()
        self._fed = []
        self._known_committed = 0

    def _sync(self, sequence: Sequence[int]) -> list[int]:
        """Roll the cache back to the longest common prefix with ``sequence``
        and return the tokens still to feed."""
        n = 0
        limit = min(len(self._fed), len(sequence))
        while n < limit and self._fed[n] == sequence[n]:
            n += 1
        if n < len(self._fed):
            self.decoder.rollback(n)
            del self._fed[n:]
        return list(sequence[n:])

    def propose(self, sequence: Sequence[int], k: int, sampler: TokenSampler) -> Draft:
        self._known_committed = len(sequence)
        if k <= 0:
            return Draft([])
        room = self.decoder.context_length - len(sequence)
        k = min(k, room)
        if k <= 0:
            return Draft([])
        todo = self._sync(sequence)
        if not todo:  # the whole sequence is cached: re-feed its last token
            self.decoder.rollback(len(self._fed) - 1)
            todo = [self._fed.pop()]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        step_seconds = []
        for i in range(k):
            start = time.perf_counter()
            logits = self.decoder.feed(todo, last_only=True).logits[-1]
            self._fed.extend(todo)
            if sampler.greedy:
                token = int(torch.argmax(logits))
            else:
                probs = sampler.probs(logits)
                token = sampler.draw(probs)
                rows.append(probs)
            tokens.append(token)
            # A step that catches up on a long run of committed tokens (the
            # prompt, at first) is not what one more draft token costs; but
            # one draft token costs no more than it, so a catch-up faster
            # than the estimate shows the estimate too high (else a first
            # step stalled by another process, with only one-token rounds
            # to explore after it, whose one step is a catch-up, would keep
            # the policy from drafting for good).
            elapsed = time.perf_counter() - start
            if len(todo) <= 2:
                step_seconds.append(elapsed)
            elif self._step_ema is not None:
                self._step_ema = min(self._step_ema, elapsed)
            todo = [token]
        if step_seconds:
            self._step_ema = refine_seconds(self._step_ema,
                                            sum(step_seconds) / len(step_seconds))
        return Draft(tokens, torch.stack(rows) if rows else None)

    def observe(self, sequence: Sequence[int], accepted: int) -> None:
        """Nothing to do: the next :meth:`propose` brings the sequence."""

    def settle(self, length: int) -> None:
        # Only the sequence seen at the last proposal is known to be
        # committed; anything fed after it is a draft that may have been
        # rejected.
        keep = min(length, self._known_committed, len(self._fed))
        if keep < len(self._fed):
            self.decoder.rollback(max(keep, self.decoder.committed_length))
            del self._fed[self.decoder.length:]

    def step_seconds(self) -> float:
        return self._step_ema if self._step_ema is not None else 0.0
