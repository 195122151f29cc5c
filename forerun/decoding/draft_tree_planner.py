"""Sizing a draft model's tree each round from measured costs and measured
acceptance: the :class:`~forerun.decoding.speculative.Planner` of
:class:`~forerun.drafters.draft_model_tree.DraftModelTreeDrafter`.

Before drafting, the depth: about two levels past the accepted length of
recent tree rounds, when a tree of the recent size, accepting what recent
trees accepted, would beat both a plain step and the best chain at the
measured costs.  Where it would not, the cheapest tree: a chain of the
draft's first choices, of the length that maximises tokens per second from
the per-level acceptance of past rounds, as
:class:`~forerun.decoding.draft_length.AdaptiveDraftLength` chooses a
chain's length (so the adaptive tree drafts at least where the adaptive
chain would, and trees only where they beat it); and where no chain pays
either, a plain step.  A tree's estimates come from tree rounds only, so
until the first tree round, and again every ``stale_every`` rounds, a tree
that beats a plain step is drafted even where the chain looks better: its
acceptance is only known by drafting one.  (On code, with the 0.5B Qwen
draft on an AMD EPYC, trees four to eight levels deep accepted 5 to 6.5
tokens a round but drafted for 200 ms, and ran at half the chain's speed.)  Like
the adaptive draft length, it explores
(:class:`~forerun.decoding.draft_length.Exploration`): a chain of one draft
every few plain rounds where drafting could pay at all, and one level or
node more than chosen every few dozen rounds, so costs measured on a busy
machine do not keep it from drafting for good.

After drafting, the node budget (EAGLE-2's reranking), for top-token
children: the drafted nodes
enter best-first by cumulative draft probability ``s`` (the drafter's
:meth:`~forerun.drafters.draft_model_tree.DraftModelTreeDrafter.select`);
node ``i`` is accepted with probability about ``c * s_i``, where ``c``
calibrates the draft's confidence against what the target accepted in past
rounds.  A round of the first ``N`` nodes commits ``1 + sum c * s_i`` tokens
on average and costs the drafting plus a verification of ``N + 1``
positions; the planner keeps the ``N`` with the most tokens per second.
With siblings sampled from the draft, how many siblings a node keeps must
not depend on what was drawn there (recursive rejection would not be exact),
so the budget is the one the previous round's drafts called for, and whole
sibling groups enter by their parent's probability.  ``nodes`` fixes ``N``
instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from forerun.decoding.base import check_count
from forerun.decoding.draft_length import (
    OPTIMISTIC_ACCEPTANCE,
    AcceptanceEstimate,
    Exploration,
    VerifyCosts,
    best_chain_length,
    expected_tokens,
)
from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.drafter import ReadsContext, ReadsTargetStates
from forerun.decoding.limits import MAX_TREE_NODES
from forerun.decoding.sampling import TokenSampler


class NodeBudgetPolicy:
    """The depth before drafting and the node count after; see the module
    docstring."""

    def __init__(self, max_nodes: int = 16, max_depth: int = 8,
                 explore_every: int = 8, stale_every: int = 64) -> None:
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.costs = VerifyCosts(max_nodes + 1)
        self.exploration = Exploration(explore_every, stale_every)
        self.accepted = 1.0          # decayed mean accepted drafts per round
        self.nodes = 4.0             # decayed mean nodes verified per round
        #: the chance a level's draft is accepted, given its parent was
        #: (the chain fallback's estimate)
        self.levels = AcceptanceEstimate()
        self._predicted = 1.0        # decayed sums behind the calibration c
        self._actual = 1.0
        #: whether the last :meth:`depth` drafts more than pays, to explore
        #: (a chain, which its round verifies whole, or a tree whose budget
        #: takes a node more: else the estimates could never recover)
        self.exploring = False
        self._probe = False          # a stale round in tree mode: see budget
        #: whether the last :meth:`depth` asks for a chain (one child per
        #: node, every drafted node verified) instead of a tree
        self.chain = False
        #: the node budget of the next round with sampled siblings, chosen
        #: from the last round's drafts (see DraftTreePlanner.draft)
        self.planned = 4
        self._tree_rounds = 0        # tree rounds learned from
        self._since_tree = 0         # depth() calls since the last tree

    @property
    def confidence_scale(self) -> float:
        """``c``: accepted drafts per unit of cumulative draft probability."""
        return min(2.0, max(0.2, self._actual / self._predicted))

    def natural_depth(self, cap: int) -> int:
        """About two levels past the recent accepted length, within ``cap``."""
        return max(1, min(self.max_depth, cap, math.ceil(self.accepted) + 2))

    def depth(self, cap: int, draft_seconds) -> int:
        """Levels to draft (0: a plain step), and whether as a chain
        (:attr:`chain`); ``draft_seconds(depth, chain)``: the drafter's
        cost.  A tree where it beats a plain step and the best chain (or
        its acceptance is unknown: no tree round yet, or none for
        ``stale_every`` rounds).  Exploring follows :class:`Exploration`: a
        chain of one draft, or, on a stale round, one chain level or one
        tree node (:meth:`budget`) more than chosen."""
        depth = self.natural_depth(cap)
        nodes = max(1, min(cap, round(self.nodes)))
        self.exploring = self.chain = self._probe = False
        tree = (1.0 + self.accepted) / (self.costs(nodes + 1) + draft_seconds(depth, False))
        chain = self.chain_length(cap, self.levels.rate, draft_seconds)
        self._since_tree += 1
        unknown = self._tree_rounds == 0 or self._since_tree >= self.exploration.stale_every
        if tree > 1.0 / self.costs(1) and (
                unknown or tree > self.chain_rate(chain, self.levels.rate, draft_seconds)):
            self._since_tree = 0
            self._probe = self.exploring = self.exploration.adjust(depth, lambda: False) > depth
            return depth
        optimistic = max(self.levels.rate, OPTIMISTIC_ACCEPTANCE)
        k = min(cap, self.max_depth, self.exploration.adjust(
            chain, lambda: self.chain_length(cap, optimistic, draft_seconds) > 0))
        self.chain = k > 0
        self.exploring = k > chain
        return k

    def chain_rate(self, k: int, rate: float, draft_seconds) -> float:
        """Expected tokens per second of a round drafting a chain of ``k``
        (0: a plain step) accepted level by level with probability ``rate``."""
        cost = (draft_seconds(k, True) if k else 0.0) + self.costs(k + 1)
        return expected_tokens(k, rate) / cost

    def chain_length(self, cap: int, rate: float, draft_seconds) -> int:
        """The chain length in ``0..min(cap, max_depth)`` with the most
        expected tokens per second when each level is accepted with
        probability ``rate`` (0: no chain beats a plain step)."""
        return best_chain_length(min(cap, self.max_depth), rate,
                                 lambda k: draft_seconds(k, True), self.costs)

    def budget(self, scores: Sequence[float], draft_seconds: float, cap: int) -> int:
        """The node count ``N <= cap`` to verify, from the cumulative draft
        probabilities of the nodes in the order they enter the tree (one
        more than pays on a stale round, see :meth:`depth`)."""
        c = self.confidence_scale
        best_n, best_rate, expected = 0, 1.0 / (self.costs(1) + draft_seconds), 1.0
        for n, s in enumerate(scores[:cap], 1):
            expected += min(1.0, c * s)
            rate = expected / (self.costs(n + 1) + draft_seconds)
            if rate > best_rate * 1.0001:
                best_n, best_rate = n, rate
        if self._probe:
            best_n = min(best_n + 1, len(scores), cap)
        return best_n

    def learn(self, scores: Sequence[float], accepted: int, depth: int) -> None:
        """A verified round: the nodes' cumulative draft probabilities, how
        many drafted tokens the target accepted, and the verified tree's
        depth."""
        self.levels.update(depth, accepted)
        decay = 0.9
        if not self.chain:    # a tree's estimates: from tree rounds only
            self._tree_rounds += 1
            self.accepted = decay * self.accepted + (1 - decay) * accepted
            self.nodes = decay * self.nodes + (1 - decay) * len(scores)
        self._predicted = decay * self._predicted + sum(scores)
        self._actual = decay * self._actual + accepted


class DraftTreePlanner:
    """A :class:`~forerun.drafters.draft_model_tree.DraftModelTreeDrafter`
    with :class:`NodeBudgetPolicy`.  ``nodes``: a fixed node budget (the
    best ``nodes`` drafted nodes every round) instead of the cost-based one,
    up to ``max_nodes``."""

    drafts_trees = True
    wants_confidence = False
    needs_hidden = False

    def __init__(self, drafter, *, nodes: int | None = None, max_nodes: int = 16,
                 max_depth: int = 8) -> None:
        if nodes is not None:
            check_count("the tree's node count", nodes, MAX_TREE_NODES)
        check_count("max_nodes", max_nodes, MAX_TREE_NODES)
        self.drafter = drafter
        self.name = drafter.name
        #: a drafter from the target's states gets them every round
        self.hidden_layers: tuple[int, ...] = (
            tuple(drafter.hidden_layers) if isinstance(drafter, ReadsTargetStates) else ())
        self.fixed_nodes = nodes
        self.policy = NodeBudgetPolicy(max(max_nodes, nodes or 0), max_depth)
        self._scores: list[float] = []
        self._drafted = False
        self.rounds = 0      # rounds of this generation so far

    def needs_calibration(self) -> bool:
        return self.fixed_nodes is None

    def calibrate(self, target, token: int) -> None:
        self.policy.costs.calibrate(target, token)

    def begin(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> None:
        self.drafter.begin(prompt_ids)
        self._scores = []
        self.rounds = 0

    def draft(self, sequence: Sequence[int], hidden: torch.Tensor | None, room: int,
              sampler: TokenSampler) -> DraftTree:
        if self.hidden_layers and hidden is not None:
            self.drafter.take_states(sequence, hidden)
        cap = min(room, self.fixed_nodes or self.policy.max_nodes)
        self._scores = []
        self._drafted = False
        if cap <= 0:
            return DraftTree.chain(sequence[-1], [])
        chain = False
        self.rounds += 1
        # What the drafter must read before it drafts counts for any draft.
        read = (self.drafter.catch_up_seconds(sequence, self.rounds)
                if self.fixed_nodes is None and isinstance(self.drafter, ReadsContext) else 0.0)

        def draft_seconds(depth: int, chain: bool = False) -> float:
            return self.drafter.draft_seconds(depth, chain) + (read if depth > 0 else 0.0)

        if self.fixed_nodes is not None:
            depth = self.policy.natural_depth(cap)
        else:
            depth = self.policy.depth(cap, draft_seconds)
            chain = self.policy.chain
        if depth == 0:
            return DraftTree.chain(sequence[-1], [])
        self._drafted = True
        nodes = self.drafter.expand(sequence, depth, sampler, chain=chain)
        drafter, seconds = self.drafter, draft_seconds(depth)
        if chain:
            chosen = list(range(len(nodes.tokens)))      # the whole chain
        elif sampler.greedy or not drafter.sample_siblings:
            # Top-token children: the budget may follow this round's scores.
            chosen = drafter.select(nodes, cap)
            scores = [nodes.scores[i] for i in chosen[1:]]
            n = len(scores) if self.fixed_nodes is not None else \
                self.policy.budget(scores, seconds, cap)
            chosen = chosen[:n + 1]
        else:
            # Sampled siblings: the budget must not depend on what this round
            # drew, so it is the one the last round's scores called for.
            planned = cap if self.fixed_nodes is not None else min(cap, self.policy.planned)
            chosen = drafter.select_groups(nodes, planned)
            if self.fixed_nodes is None:
                ranked = drafter.select_groups(nodes, cap)
                self.policy.planned = max(1, self.policy.budget(
                    [nodes.scores[i] for i in ranked[1:]], seconds, cap))
        self._scores = [nodes.scores[i] for i in chosen[1:]]
        return drafter.tree(nodes, chosen)

    def learn(self, sequence: Sequence[int], tree: DraftTree, path: list[int],
              confidence: Sequence[float] | None = None) -> None:
        accepted = len(path) - 1
        self.drafter.observe(sequence, accepted)
        if self._drafted:
            # Also a round whose budget kept no node: the draft time was
            # spent for nothing, which the estimates must learn.
            self.policy.learn(self._scores, accepted, tree.depth)

    def settle(self, length: int) -> None:
        self.drafter.settle(length)
