"""A small draft model that shares the target's tokenizer."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from forerun.decoding.draft_length import refine_seconds
from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import TokenSampler, greedy_token
from forerun.drafters.draft_context import DraftContext
from forerun.drafters.lookup_or_draft_planner import lookup_or_model
from forerun.drafters.method_target import MethodOptions, MethodTarget, chain
from forerun.protocol.decoder import Decoder

#: committed tokens fed without a timed draft step after which a one-token
#: proposal that starts with a catch-up splits it, to time its step (see
#: :meth:`DraftModelDrafter.propose`; the tree drafter's catch-ups alike)
STALE_STEP = 64
#: one-token feeds a drafter times before its first draft step, to price
#: its steps and reads (see :meth:`DraftModelDrafter._time_steps`)
FIRST_STEPS = 3


class DraftModelDrafter:
    """Drafts autoregressively with its own Decoder.

    Its cache always holds a prefix of its view of the committed sequence
    (plus, during a round, its own drafts; :mod:`.draft_context`); each
    proposal first feeds the committed tokens it lacks, then drafts.  After
    verification nothing is re-fed that the cache already holds: a rejected
    tail is rolled back in O(1).  ``window``: the most tokens of a prompt
    it reads (:class:`~.draft_context.DraftContext`).
    """

    name = "draft"

    def __init__(self, decoder: Decoder, *, window: int | None = None) -> None:
        self.decoder = decoder
        # What the cache holds: the view of the committed sequence (all of
        # it, or a long prompt cut to ``window`` tokens), then drafts.
        self.context = DraftContext(decoder, window)
        self._known_committed = 0     # view length of the last committed sequence seen
        self._step_ema: float | None = None
        self._untimed = 0             # committed tokens fed since the last timed step

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.context.begin(prompt_ids)
        self._known_committed = 0

    def propose(self, sequence: Sequence[int], k: int, sampler: TokenSampler) -> Draft:
        view = self.context.view(sequence)
        self._known_committed = len(view)
        if k <= 0:
            return Draft([])
        k = min(k, self.decoder.context_length - len(view))
        if k <= 0:
            return Draft([])
        todo = self.context.catch_up(view)
        fed = self.context.fed
        self._untimed += len(todo)
        if k == 1 and len(todo) > 2 and self._untimed >= STALE_STEP:
            # The round's one step would be a catch-up, which does not time
            # a draft step.  When no step was timed for STALE_STEP tokens (a
            # policy that drafts one token now and then, to explore, after
            # plain or lookup rounds), the estimate may be one a stalled
            # step left too high, which keeps the policy from drafting more
            # for good.  So the committed tokens go in first and the step is
            # timed alone: one forward more, once in STALE_STEP tokens.
            self.decoder.feed(todo[:-1], last_only=True)
            fed.extend(todo[:-1])
            todo = todo[-1:]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        step_seconds = []
        for _ in range(k):
            start = time.perf_counter()
            logits = self.decoder.feed(todo, last_only=True).logits[-1]
            fed.extend(todo)
            if sampler.greedy:
                token = greedy_token(logits)
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
            self.context.note_read(len(todo), elapsed)
            if len(todo) <= 2:
                step_seconds.append(elapsed)
            elif self._step_ema is not None:
                self._step_ema = min(self._step_ema, elapsed)
            todo = [token]
        if step_seconds:
            self._step_ema = refine_seconds(self._step_ema,
                                            sum(step_seconds) / len(step_seconds))
            self._untimed = 0
        return Draft(tokens, torch.stack(rows) if rows else None)

    def observe(self, sequence: Sequence[int], accepted: int) -> None:
        """Nothing to do: the next :meth:`propose` brings the sequence."""

    def settle(self, length: int) -> None:
        # Only the sequence seen at the last proposal is known to be
        # committed; anything fed after it is a draft that may have been
        # rejected.
        self.context.settle(min(self.context.view_length(length), self._known_committed))

    def step_seconds(self) -> float:
        """What one draft step costs: the timed steps' estimate, or, before
        any step was timed, :data:`FIRST_STEPS` steps timed now."""
        if self._step_ema is None:
            self._step_ema = self._time_steps()
        return self._step_ema

    def _time_steps(self) -> float:
        """The fastest of :data:`FIRST_STEPS` one-token feeds at the cache's
        current length, each rolled back (the cache and the view are left as
        they were).  Without it the policy of a fresh drafter (every
        generation's first in a new process) prices its steps, and the read
        of a long prompt's window, at nothing, and reads the window where
        the answer is too short to pay it back (a 2,300-token prompt asking
        for 32 tokens ran 0.95x plain decoding on a Zen 4).  The first feed
        of a model just loaded may be slow (its weights not yet in memory),
        so the fastest counts."""
        decoder = self.decoder
        base = decoder.length
        if base + 1 > decoder.context_length:
            return 0.0
        token = self.context.fed[-1] if self.context.fed else 0   # (any token times alike)
        best = float("inf")
        for _ in range(FIRST_STEPS):
            start = time.perf_counter()
            decoder.feed([token], last_only=True)
            best = min(best, time.perf_counter() - start)
            decoder.rollback(base)
        return best

    def catch_up_seconds(self, sequence: Sequence[int], rounds: int) -> float:
        """What reading the committed tokens it lacks costs a round
        (:class:`~forerun.decoding.drafter.ReadsContext`;
        :meth:`~forerun.drafters.draft_context.DraftContext.read_seconds`)."""
        return self.context.read_seconds(sequence, rounds, self.step_seconds())


def drafter_of(target: MethodTarget, options: MethodOptions) -> DraftModelDrafter:
    """The chain drafter of the draft model ``options.draft`` names."""
    return DraftModelDrafter(target.draft_decoder(options.draft), window=options.draft_window)


def chains(target: MethodTarget, options: MethodOptions):
    """A draft model's chains alone (the registry's ``draft``)."""
    return chain(target, drafter_of(target, options), options)


def beside_lookup(target: MethodTarget, options: MethodOptions):
    """A draft model's chains beside prompt lookup (``draft-lookup``)."""
    return lookup_or_model(target, drafter_of(target, options), options, "draft")
