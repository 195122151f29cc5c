"""Speculative decoding: a drafter proposes, the target verifies all
proposals in one forward, and an acceptance rule keeps the output exactly
the target's.

Invariant between rounds: the target's cache holds every committed token but
the last one, which is fed at the head of the next verification together
with the drafts (``k + 1`` positions).  Rejected positions are rolled back in
O(1); nothing the cache holds is fed again.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from ..decoder import Decoder
from ..drafters.base import Drafter
from ..errors import ConfigError
from ..stats import GenerationStats
from ..sampling import TokenSampler
from .acceptance import accept_greedy, accept_sampled
from .base import DraftAndVerify
from .draft_length import AdaptiveDraftLength
from .finite import finite
from .prefill import prefill

MAX_DRAFT_LENGTH = 16


class SpeculativeDecoding(DraftAndVerify):
    """Draft-then-verify decoding over any :class:`~forerun.drafters.base.Drafter`.

    ``k``: a fixed draft length, or ``None`` to choose it every round from
    measured costs (:mod:`forerun.decoding.draft_length`), up to ``max_k``.
    """

    def __init__(self, target: Decoder, drafter: Drafter, *, k: int | None = None,
                 max_k: int = 8, name: str | None = None) -> None:
        if k is not None and not (isinstance(k, int) and 1 <= k <= MAX_DRAFT_LENGTH):
            raise ConfigError(f"draft length k must be an integer in 1..{MAX_DRAFT_LENGTH}, got {k!r}")
        if not 1 <= max_k <= MAX_DRAFT_LENGTH:
            raise ConfigError(f"max_k must lie in 1..{MAX_DRAFT_LENGTH}, got {max_k}")
        self.target = target
        self.drafter = drafter
        self.fixed_k = k
        self.name = name or drafter.name
        self.policy = AdaptiveDraftLength(max_k)
        self._calibrated = False
        self.cost_store = None   # optional: persists calibration (see api)

    def _calibrate(self, token: int) -> None:
        if self._calibrated or self.fixed_k is not None:
            return
        self._use_stored_or_measure(lambda: self.policy.costs.calibrate(self.target, token))

    def _draft_length(self, room: int) -> int:
        if self.fixed_k is not None:
            k = self.fixed_k
        else:
            k = self.policy.choose(self.drafter.step_seconds())
        return max(0, min(k, room))

    def run(self, prompt_ids: list[int], sampler: TokenSampler,
            stats: GenerationStats) -> Iterator[list[int]]:
        target, drafter = self.target, self.drafter
        drafter.begin(prompt_ids)
        sequence = list(prompt_ids)
        start = time.perf_counter()
        # The prefill is plain decoding's (an engine may compute a prefill
        # with other kernels than a verification), and its logits give the
        # first token.
        logits = finite(prefill(target, sequence).logits[-1])
        self._calibrate(sequence[-1])
        stats.prefill_seconds = time.perf_counter() - start
        stats.verify_group = target.verify_group
        first = sampler.pick(logits)
        sequence.append(first)
        yield [first]
        vocab = target.vocab_size
        while True:
            room = target.context_length - target.length - 1
            k = self._draft_length(room)
            t0 = time.perf_counter()
            draft = drafter.propose(sequence, k, sampler) if k else None
            tokens = draft.tokens if draft else []
            draft_probs = draft.probs if draft else None
            # A draft vocabulary wider than the target's can't be fed past its
            # first out-of-range token.  That draft has target probability 0,
            # so it is always rejected; but a sampled one must still go to the
            # acceptance rule, whose rejection draws from norm(max(0, p - q))
            # there (drawing from p instead would not be lossless).
            cut = next((i for i, t in enumerate(tokens) if t >= vocab), None)
            if cut is not None:
                keep = cut + 1 if draft_probs is not None else cut
                tokens = tokens[:keep]
                draft_probs = None if draft_probs is None else draft_probs[:keep]
            fed = tokens if cut is None else tokens[:cut]
            t1 = time.perf_counter()
            base = target.length
            logits = finite(target.feed([sequence[-1]] + fed).logits)
            t2 = time.perf_counter()
            if sampler.greedy:
                n, extra = accept_greedy(fed, logits)
            else:
                target_probs = sampler.probs(logits)
                if len(fed) < len(tokens):
                    # The row after the out-of-range draft is never read.
                    target_probs = torch.cat([target_probs, target_probs[-1:]])
                n, extra = accept_sampled(tokens, draft_probs, target_probs,
                                          sampler.generator)
            target.rollback(base + 1 + n)
            committed = tokens[:n] + [extra]
            sequence.extend(committed)
            drafter.observe(sequence, n)
            stats.record_round(drafted=len(tokens), accepted=n, draft_seconds=t1 - t0,
                               verify_seconds=t2 - t1)
            if tokens:
                self.policy.acceptance.update(len(tokens), n)
            self.policy.costs.observe(len(fed) + 1, t2 - t1)
            yield committed

