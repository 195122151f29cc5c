"""What every drafter of token trees by its own probabilities shares (a
draft model, an EAGLE head; :mod:`forerun.drafters.draft_model_tree` says
how a round drafts): the drafted nodes, how a node's children are chosen
(top tokens, or siblings sampled without replacement), which nodes a
round keeps within its budget, and what drafting a tree costs."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from forerun.decoding.draft_tree import DraftTree, topology
from forerun.decoding.draft_tree_planner import DraftTreePlanner
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.drafters.method_target import MethodOptions, MethodTarget
from forerun.errors import ConfigError


@dataclass
class DraftedNodes:
    """Every node a round drafted, before selection.  Node 0 is the root.
    ``scores[i]``: the cumulative draft probability of node ``i``'s path.
    ``children[i]``: in draw order.  ``sibling_probs[i]``: the distribution
    node ``i``'s children were drawn from (sampled siblings only)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)
    sibling_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
        self.scores.append(float(score))
        self.children.append([])
        if parent >= 0:
            self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1


def level_mask(nodes: DraftedNodes, frontier: list[int], slot: dict[int, int], committed: int,
               base: int) -> torch.Tensor:
    """The attention mask of one level's forward: the nodes ``frontier``, fed
    at cache slots ``base ..``, each see the ``committed`` slots, their fed
    ancestors (at ``slot[node]``) and themselves."""
    mask = torch.zeros(len(frontier), base + len(frontier), dtype=torch.bool)
    mask[:, :committed] = True
    for i, node in enumerate(frontier):
        mask[i, base + i] = True
        parent = nodes.parents[node]
        while parent > 0:
            mask[i, slot[parent]] = True
            parent = nodes.parents[parent]
    return mask


class TreeDrafting:
    """The choices of a tree drafter.  ``width``: children per expanded node
    (at most, for sampled children); ``beam``: nodes expanded per level;
    ``sample_siblings``: when sampling, draw children from the draft
    distribution instead of taking its top tokens; ``sibling_coverage``:
    the share of a node's draft probability mass its sampled children's
    count is sized to (see :meth:`sibling_count`).  A subclass times its
    forwards into ``_level_seconds`` (of ``beam`` nodes: ``False``; of a
    chain's one node: ``True``) and ``_catch_up_seconds``."""

    def __init__(self, *, width: int = 4, beam: int = 4, sample_siblings: bool = True,
                 sibling_coverage: float = 0.8) -> None:
        for label, value in (("width", width), ("beam", beam)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be a positive integer, got {value!r}")
        if not isinstance(sibling_coverage, (int, float)) or not 0 < sibling_coverage <= 1:
            raise ConfigError(f"sibling_coverage must be a share of probability mass in "
                              f"(0, 1], got {sibling_coverage!r}")
        self.sibling_coverage = float(sibling_coverage)
        self.width = width
        self.beam = beam
        self.sample_siblings = sample_siblings
        self._level_seconds: dict[bool, float] = {}
        self._catch_up_seconds: float | None = None

    def _children(self, logits: torch.Tensor, sampler: TokenSampler,
                  count: int) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """``count`` child tokens of a node with draft ``logits``, the
        distribution they are scored by, and (sampled siblings) the one they
        were drawn from."""
        if sampler.greedy or not self.sample_siblings:
            probs = torch.softmax(logits.float(), dim=-1) if sampler.greedy \
                else sampler.probs(logits)
            top = torch.topk(probs, min(count, probs.numel())).indices.tolist()
            return [t for t in top if float(probs[t]) > 0] or top[:1], probs, None
        probs = sampler.probs(logits)
        left = probs.clone()
        tokens = []
        for _ in range(self.sibling_count(probs, count)):   # without replacement, in draw order
            if float(left.sum()) <= 0:
                break
            token = sampler.draw(left / left.sum())
            tokens.append(token)
            left[token] = 0.0
        return tokens, probs, probs

    def sibling_count(self, probs: torch.Tensor, width: int) -> int:
        """How many children to draw from a node's draft distribution
        ``probs``: as many as its top tokens need to cover
        ``sibling_coverage`` of its mass, at most ``width``.

        It depends on the node's own distribution only, never on what is
        drawn there: recursive rejection stays exact when the number of
        siblings does not depend on the siblings' own draws."""
        probs = probs.float()
        top = torch.topk(probs, min(width, probs.numel())).values
        short = torch.cumsum(top, 0) < self.sibling_coverage * float(probs.sum())
        return min(width, int(short.sum()) + 1)

    @staticmethod
    def select(nodes: DraftedNodes, budget: int) -> list[int]:
        """The best ``budget`` drafted nodes by cumulative probability, each
        entering after its parent and its previous sibling; in the order
        they entered (parents first, siblings in draw order).

        For top-token children only: which and how many of them enter then
        depends on their own draft probabilities, which the point-mass
        acceptance rule allows but recursive rejection of sampled siblings
        does not (see :meth:`select_groups`)."""
        chosen = [0]
        heap: list[tuple[float, int]] = []

        def offer(parent: int, index: int) -> None:
            kids = nodes.children[parent]
            if index < len(kids):
                c = kids[index]
                heapq.heappush(heap, (-nodes.scores[c], c))

        offer(0, 0)
        while heap and len(chosen) <= budget:
            _, c = heapq.heappop(heap)
            chosen.append(c)
            parent = nodes.parents[c]
            offer(parent, nodes.children[parent].index(c) + 1)
            offer(c, 0)
        return chosen

    @staticmethod
    def select_groups(nodes: DraftedNodes, budget: int) -> list[int]:
        """At most ``budget`` drafted nodes in whole sibling groups, level by
        level, and within a level best-first by the *parent's* cumulative
        probability (the last group cut to a prefix of its draw order); in
        the order they entered.

        For sampled siblings: recursive rejection is exact when the number of
        siblings kept at a node does not depend on what was drawn there.
        Here it depends only on what was drawn at shallower levels (which
        groups exist, and the parents' scores), never on the siblings' own
        tokens nor on anything drafted after them."""
        chosen = [0]
        heap: list[tuple[int, float, int]] = [(0, -1.0, 0)] if nodes.children[0] else []
        while heap and len(chosen) <= budget:
            _, _, parent = heapq.heappop(heap)
            for c in nodes.children[parent][:budget + 1 - len(chosen)]:
                chosen.append(c)
                if nodes.children[c]:
                    heapq.heappush(heap, (nodes.depths[c], -nodes.scores[c], c))
        return chosen

    @staticmethod
    def tree(nodes: DraftedNodes, chosen: list[int]) -> DraftTree:
        """The :class:`DraftTree` of the ``chosen`` nodes (from :meth:`select`)."""
        index = {n: i for i, n in enumerate(chosen)}
        shape = topology([-1] + [index[nodes.parents[n]] for n in chosen[1:]])
        siblings = {index[n]: q for n, q in nodes.sibling_probs.items() if n in index}
        return DraftTree(shape, [nodes.tokens[n] for n in chosen], siblings)

    def draft_seconds(self, depth: int, chain: bool = False) -> float:
        """Estimated seconds to draft ``depth`` levels (of a chain:
        ``chain``): a catch-up forward and ``depth - 1`` level forwards,
        each taken for the other until it is measured, and a chain's level
        for a tree's (0 before the first measurement)."""
        if depth <= 0:
            return 0.0
        level = self._level_seconds.get(chain, self._level_seconds.get(not chain))
        catch_up = self._catch_up_seconds
        catch_up = catch_up if catch_up is not None else (level or 0.0)
        level = level if level is not None else catch_up
        return catch_up + (depth - 1) * level



def tree_method(target: MethodTarget, drafter: TreeDrafting,
                options: MethodOptions) -> SpeculativeDecoding:
    """Trees that ``drafter`` (a draft model's or an EAGLE head's) drafts,
    verified in one forward each."""
    target.verification_grouping()
    return SpeculativeDecoding(target.decoder,
                               planner=DraftTreePlanner(drafter, nodes=options.tree_nodes),
                               cost_store=target.cost_store("+draft-tree"))
