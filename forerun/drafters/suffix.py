"""Suffix drafting: draft what followed the longest earlier match of the
text's last tokens, in this generation (prompt lookup) or in what the model
read and wrote for earlier requests.

Agent loops, repeated edits of one file and regenerated chat answers make a
model write what it wrote before, where prompt lookup, blind to earlier
requests, finds nothing.  vLLM's suffix decoding (SuffixDecoding, Oliaro et
al. 2024) and llama.cpp's n-gram caches draft from a model's earlier
output; this drafter does so with a :class:`~forerun.drafters.suffix_store.SuffixStore`
that a :class:`~forerun.api.model.Model` shares between its requests (and
``forerun serve`` between its clients).

**Two stores, one rule.**  Each generation keeps its own sequence (prompt
and output so far) in a store of its own, and reads the shared store of
earlier requests; the longer match drafts, this generation's own among
equals.  When a generation ends (:meth:`SuffixDrafter.settle`) its output,
with up to :data:`PROMPT_TOKENS` prompt tokens before it, is recorded in
the shared store.  A request sees another's text only as drafts, which the
target verifies: the output is the target's whatever the store holds.

**Draft length** (:class:`SuffixPlanner`).  A longer match predicts its
continuation better: an answer regenerated word for word matches over
dozens of tokens, a phrase that recurs by chance over two or three.  The
planner keeps an acceptance estimate per band of match length
(:data:`BANDS`), learnt from every round, and drafts the length that
maximises expected tokens per second under the target's measured
verification costs (the same rule as prompt lookup beside a draft model,
:mod:`forerun.drafters.lookup_or_draft_planner`); a round whose match
cannot pay is a plain step.  A proposal not drafted is still checked
against what the round committed, so a band's estimate recovers after a
run of misses.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from forerun.decoding.base import check_count
from forerun.decoding.draft_length import (
    MAX_DRAFT_LENGTH,
    AcceptanceEstimate,
    AdaptiveDraftLength,
    best_draft_length,
)
from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.drafters.method_target import MethodOptions, MethodTarget
from forerun.drafters.suffix_store import SuffixStore
from forerun.protocol.decoder import Decoder

if TYPE_CHECKING:
    from forerun.machine.calibration import CalibrationStore

#: prompt tokens recorded before a generation's output: the context that
#: tells where a later request's answer starts like this one
PROMPT_TOKENS = 256
#: the lower bounds of the match-length bands that learn their acceptance
BANDS = (2, 4, 8, 16, 32)
#: each band's acceptance before it is measured: prompt lookup's 2-4 token
#: matches were accepted about half the time on the bench's prompts; a
#: match of 32 tokens is text repeating
PRIORS = (0.4, 0.5, 0.65, 0.8, 0.9)


class SuffixDrafter:
    """A deterministic :class:`~forerun.decoding.drafter.Drafter` over this
    generation's own sequence and ``store`` (shared; a store of its own if
    ``None``).  ``match_length`` is the match its last proposal came from
    (0: none), ``source`` where (``"own"`` or ``"shared"``)."""

    name = "suffix"

    def __init__(self, store: SuffixStore | None = None) -> None:
        self.store = store if store is not None else SuffixStore()
        self.own: SuffixStore | None = None      # this generation's (begin)
        self.match_length = 0
        self.source: str | None = None
        self._prompt = 0
        self._sequence: Sequence[int] = ()
        self._recorded = True
        self._lookup_seconds = 0.0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._start(prompt_ids)

    def _start(self, prompt_ids: Sequence[int]) -> SuffixStore:
        own = SuffixStore(1 << max(12, (2 * len(prompt_ids)).bit_length()), grow=True)
        own.open()
        own.extend(prompt_ids)
        self.own = own
        self._prompt = len(prompt_ids)
        self._sequence = list(prompt_ids)
        self._recorded = False
        return own

    def _sync(self, sequence: Sequence[int]) -> SuffixStore:
        """This generation's own store, holding ``sequence``."""
        own = self.own
        if own is not None:
            held, last = own.open_length, own.last(8)
            if held <= len(sequence) and list(sequence[held - len(last):held]) == last:
                own.extend(sequence[held:])
            else:
                own = None
        if own is None:
            own = self._start(sequence)    # not a continuation of this generation
        self._sequence = sequence
        return own

    def propose(self, sequence: Sequence[int], k: int, sampler: TokenSampler) -> Draft:
        start = time.perf_counter()
        store = self._sync(sequence)
        self.match_length, self.source = 0, None
        tokens: list[int] = []
        if k > 0:
            own = store.find(sequence, k)
            shared = self.store.find(sequence, k)
            length, tokens = max(own, shared, key=lambda m: m[0])   # own among equals
            if tokens:
                self.match_length = length
                self.source = "own" if (length, tokens) == own else "shared"
        self._lookup_seconds = time.perf_counter() - start
        return Draft(tokens, None)

    def observe(self, sequence: Sequence[int], accepted: int) -> None:
        self._sequence = sequence   # (the committed sequence, read at settle)

    def settle(self, length: int) -> None:
        """The generation ended with ``length`` positions kept: record its
        output (and the prompt tokens before it) in the shared store, once."""
        if self._recorded:
            return
        self._recorded = True
        kept = list(self._sequence[:length])
        if len(kept) > self._prompt:
            self.store.record(kept[max(0, self._prompt - PROMPT_TOKENS):])

    def step_seconds(self) -> float:
        return self._lookup_seconds


def band(match_length: int) -> int:
    """The band of :data:`BANDS` a match of ``match_length`` tokens is in."""
    return max(0, bisect.bisect_right(BANDS, match_length) - 1)


class SuffixPlanner:
    """The :class:`~forerun.decoding.speculative.Planner` of suffix drafting:
    chains from a :class:`SuffixDrafter`, ``k`` tokens long (fixed) or as
    many as pay at the match's measured acceptance (see the module's text),
    up to ``max_k``."""

    needs_hidden = False
    drafts_trees = False
    wants_confidence = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, drafter: SuffixDrafter, *, k: int | None = None,
                 max_k: int = 8) -> None:
        if k is not None:
            check_count("draft length k", k, MAX_DRAFT_LENGTH)
        check_count("max_k", max_k, MAX_DRAFT_LENGTH)
        self.drafter = drafter
        self.name = drafter.name
        self.fixed_k = k
        self.max_k = max_k if k is None else k
        self.policy = AdaptiveDraftLength(self.max_k)   # (its measured costs)
        self.acceptance = [AcceptanceEstimate(prior=p) for p in PRIORS]
        self.rounds = {"own": 0, "shared": 0, "plain": 0}
        self._found: list[int] = []
        self._band = 0
        self._drafted = 0
        self._at = 0

    def needs_calibration(self) -> bool:
        return self.fixed_k is None

    def calibrate(self, target: Decoder, token: int) -> None:
        self.policy.costs.calibrate(target, token)

    def begin(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> None:
        self.drafter.begin(prompt_ids)

    def draft(self, sequence: Sequence[int], hidden: torch.Tensor | None, room: int,
              sampler: TokenSampler) -> DraftTree:
        found = self.drafter.propose(sequence, min(self.max_k, room), sampler).tokens
        self._found, self._at = found, len(sequence)
        self._band = band(self.drafter.match_length)
        k = 0
        if found:
            k = (min(self.fixed_k, len(found)) if self.fixed_k is not None else
                 best_draft_length(len(found), self.acceptance[self._band].rate, 0.0,
                                   self.policy.costs, self.policy.margin))
        self._drafted = k
        self.rounds[self.drafter.source if k and self.drafter.source else "plain"] += 1
        return DraftTree.chain(sequence[-1], found[:k])

    def learn(self, sequence: Sequence[int], tree: DraftTree, path: list[int],
              confidence: Sequence[float] | None = None) -> None:
        accepted = len(path) - 1
        self.drafter.observe(sequence, accepted)
        if not self._found:
            return
        estimate = self.acceptance[self._band]
        if self._drafted:
            estimate.update(self._drafted, accepted)
        else:           # what the proposal would have kept of this plain step
            estimate.update_undrafted(self._found, sequence[self._at:])

    def settle(self, length: int) -> None:
        self.drafter.settle(length)


def suffix_decoding(target: Decoder, store: SuffixStore, *, k: int | None = None,
                    cost_store: CalibrationStore | None = None) -> SpeculativeDecoding:
    """Speculative decoding of ``target`` with suffix drafting from
    ``store`` (a model's, shared by its requests), chains ``k`` long or as
    long as they pay (``cost_store``: where the verification costs are
    kept)."""
    return SpeculativeDecoding(target, planner=SuffixPlanner(SuffixDrafter(store), k=k),
                               cost_store=cost_store)


def build(target: MethodTarget, options: MethodOptions) -> SpeculativeDecoding:
    """Suffix drafting's method (the registry's ``suffix``): from this
    generation and the model's earlier requests (its store,
    :meth:`MethodTarget.suffix_store`), ``options.draft_k`` long or as long
    as its match pays."""
    target.verification_grouping()
    return suffix_decoding(target.decoder, target.suffix_store(), k=options.draft_k,
                           cost_store=target.cost_store())
