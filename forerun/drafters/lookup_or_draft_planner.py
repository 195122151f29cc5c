"""Prompt lookup and a draft model (or an EAGLE head) together: each round
drafts with whichever is expected to commit more tokens per second.

Prompt lookup (:mod:`forerun.drafters.ngram`) costs microseconds and is
right where the text repeats itself: a document quoted or summarised, code
being edited, a list that follows a pattern.  A draft model costs a forward
per token and is right on fluent text the prompt does not contain.  Each
round this planner:

1. looks the sequence's last tokens up in the prompt and the text so far;
2. if that found tokens, sizes a lookup draft from the lookup's own
   acceptance estimate at no drafting cost, and sizes a draft-model draft
   from the model's (the adaptive length of
   :class:`~forerun.decoding.draft_length.AdaptiveDraftLength`, with its
   exploration);
3. drafts with the one of higher expected tokens per second (expected
   tokens over drafting plus verification seconds, from the measured
   verification costs).

Each drafter's acceptance is learnt from the rounds it drafted.  The
lookup's is also learnt from the rounds the model drafted, as if it had
drafted them: its proposal is checked against the tokens the round
committed (free, as a lookup is).  Without that, a lookup that was wrong a
few times would never be tried again.  A committed token is the target's
choice (greedy) or a draw from the target's distribution (sampling), so it
equals the lookup's token as often as the target would accept it.

The draft model catches up on the tokens committed in lookup rounds the
next time it drafts, in one forward.  Both drafters see the same committed
sequence, so the output is the target's either way: a round verifies a
chain, whatever proposed it.

The model drafter is any chain drafter that times its steps: a draft model
(:class:`~forerun.drafters.draft_model.DraftModelDrafter`, which also says
what reading the committed tokens will cost,
:class:`~forerun.decoding.drafter.ReadsContext`) or an EAGLE-3 head
(:class:`~forerun.drafters.eagle.drafter.EagleDrafter`, which drafts from
the target's states: the planner asks the verification loop for them and
hands them on every round, lookup rounds included, so the head reads the
positions those committed the next time it drafts).

The lookup is prompt lookup or suffix drafting
(:class:`~forerun.drafters.suffix.SuffixDrafter`: the prompt, the text so
far and the model's earlier answers).  :func:`lookup_or_model` is the one
rule every ``*-lookup`` method of the registry builds with: a draft model
beside a lookup and an EAGLE head beside one are the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forerun.decoding.base import check_count
from forerun.decoding.draft_length import (
    MAX_DRAFT_LENGTH,
    AcceptanceEstimate,
    AdaptiveDraftLength,
    GenerationSpan,
    best_draft_length,
    expected_tokens,
)
from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.drafter import ReadsContext, ReadsTargetStates
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.drafters.method_target import MethodOptions, MethodTarget
from forerun.drafters.ngram import NgramDrafter
from forerun.drafters.suffix import SuffixDrafter
from forerun.protocol.decoder import Decoder

#: the lookup's acceptance before it has been measured: about what prompt
#: lookup reached over the bench's prompts (47%)
LOOKUP_PRIOR = 0.5


class LookupOrDraftPlanner:
    """A :class:`~forerun.decoding.speculative.Planner` of chains from
    prompt lookup or a model drafter (a draft model or an EAGLE head; see
    the module's text), up to ``max_k`` tokens a round.  ``name``: the
    planner's name in statistics (default ``"draft+lookup"``)."""

    needs_hidden = False
    drafts_trees = False
    #: the model's policy learns from the target's confidence (see learn)
    wants_confidence = True

    def __init__(self, model, lookup: NgramDrafter | SuffixDrafter | None = None, *,
                 max_k: int = 8, name: str = "draft+lookup") -> None:
        check_count("max_k", max_k, MAX_DRAFT_LENGTH)
        self.model = model
        self.lookup = lookup if lookup is not None else NgramDrafter()
        self.name = name
        #: a drafter from the target's states gets them every round
        self.hidden_layers: tuple[int, ...] = (
            tuple(model.hidden_layers) if isinstance(model, ReadsTargetStates) else ())
        self.max_k = max_k
        # The verification costs, the model's acceptance and its exploration.
        self.policy = AdaptiveDraftLength(max_k)
        self.lookup_acceptance = AcceptanceEstimate(prior=LOOKUP_PRIOR)
        self.source: str | None = None   # what drafted the last round
        self._found: list[int] = []      # the lookup's proposal in the last round
        self._drafted_at = 0             # the sequence's length when it was drafted
        self.rounds = {"lookup": 0, "model": 0}
        self.rounds_now = 0              # rounds of this generation so far
        self._read = 0.0                 # what the model must read first, in seconds
        self._span = GenerationSpan()    # this generation's prompt and budget

    def needs_calibration(self) -> bool:
        return True

    def calibrate(self, target: Decoder, token: int) -> None:
        self.policy.costs.calibrate(target, token)

    def begin(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> None:
        self.model.begin(prompt_ids)
        self.lookup.begin(prompt_ids)
        self.source = None
        self._found = []
        self.rounds_now = 0
        self._span = GenerationSpan.of(prompt_ids, max_new_tokens)

    def _rate(self, k: int, alpha: float, draft_seconds: float) -> float:
        """Expected committed tokens per second of a ``k``-token draft."""
        return expected_tokens(k, alpha) / (draft_seconds + self.policy.costs(k + 1))

    def model_length(self, sequence: Sequence[int], room: int) -> int:
        """How many tokens the draft model would draft this round (0: a
        plain step): the adaptive draft length, counting what the model
        must read first, with its exploration."""
        # the whole read (a generation one round old); a round counts its share
        whole = (self.model.catch_up_seconds(sequence, 1)
                 if isinstance(self.model, ReadsContext) else 0.0)
        self._read = whole / max(1, self.rounds_now)
        left, made = self._span.left(sequence), self._span.made(sequence)
        k = max(0, min(self.policy.choose(self.model.step_seconds(), self._read, whole, left,
                                          made), room))
        if k:
            # the read's share as the policy counted it
            self._read = self.policy.read_share(k, self._read, whole, left, made)
        return k

    def lookup_length(self, found: list[int], k_model: int) -> int:
        """How many of the lookup's ``found`` tokens to draft this round,
        or 0 to leave the round to the model (which would draft
        ``k_model``): the best length at the lookup's acceptance, if its
        expected tokens per second are at least the model's."""
        alpha = self.lookup_acceptance.rate
        k = best_draft_length(len(found), alpha, 0.0, self.policy.costs, self.policy.margin)
        model_rate = self._rate(k_model, self.policy.acceptance.rate,
                                (self._read + k_model * self.model.step_seconds())
                                if k_model else 0.0)
        return k if k and self._rate(k, alpha, 0.0) >= model_rate else 0

    def draft(self, sequence: Sequence[int], hidden: torch.Tensor | None, room: int,
              sampler: TokenSampler) -> DraftTree:
        self.rounds_now += 1
        if self.hidden_layers and hidden is not None:
            self.model.take_states(sequence, hidden)
        k_model = self.model_length(sequence, room)
        found = self.lookup.propose(sequence, min(self.max_k, room), sampler).tokens
        self._found, self._drafted_at = found, len(sequence)
        k = self.lookup_length(found, k_model) if found else 0
        if k:
            self.source = "lookup"
            self.rounds["lookup"] += 1
            return DraftTree.chain(sequence[-1], found[:k])
        self.source = "model"
        self.rounds["model"] += 1
        if not k_model:
            return DraftTree.chain(sequence[-1], [])
        draft = self.model.propose(sequence, k_model, sampler)
        return DraftTree.chain(sequence[-1], draft.tokens, draft.probs)

    def learn(self, sequence: Sequence[int], tree: DraftTree, path: list[int],
              confidence: Sequence[float] | None = None) -> None:
        accepted = len(path) - 1
        self.model.observe(sequence, accepted)
        self.lookup.observe(sequence, accepted)
        if self.source == "lookup":
            self.lookup_acceptance.update(tree.num_nodes, accepted)
            # the model learns from the target's confidence where it did not draft
            self.policy.learn(0, 0, confidence)
        else:
            self.policy.learn(tree.num_nodes, accepted, confidence)
        if self.source == "model" and self._found:
            # What the lookup's proposal would have kept of this round.
            self.lookup_acceptance.update_undrafted(self._found,
                                                    sequence[self._drafted_at:])

    def settle(self, length: int) -> None:
        self.model.settle(length)
        self.lookup.settle(length)


def lookup_or_model(target: MethodTarget, model, options: MethodOptions,
                    kind: str) -> SpeculativeDecoding:
    """The one rule of every ``*-lookup`` method: ``model`` (a draft
    model's or an EAGLE head's chain drafter) beside a lookup, each round
    drafting with the one expected to pay more.  The lookup is prompt
    lookup (``options.draft_lookup == "ngram"``) or suffix drafting, which
    also looks in the model's earlier answers (``"suffix"``); the planner is
    named ``KIND+LOOKUP`` in statistics (``draft+lookup``, ``eagle+suffix``)."""
    if options.draft_lookup == "suffix":
        lookup: NgramDrafter | SuffixDrafter = SuffixDrafter(target.suffix_store())
        name = f"{kind}+suffix"
    else:
        lookup, name = NgramDrafter(), f"{kind}+lookup"
    target.verification_grouping()
    return SpeculativeDecoding(target.decoder,
                               planner=LookupOrDraftPlanner(model, lookup, name=name),
                               cost_store=target.cost_store())
