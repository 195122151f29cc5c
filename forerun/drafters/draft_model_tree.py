"""A draft model that drafts a token tree by its own probabilities
(EAGLE-2's dynamic draft tree, Li et al. 2024, with a separate draft model as
in SpecInfer and Sequoia).

A round, from the committed sequence whose last token is the root:

1. the draft model feeds the committed tokens it lacks (the last accepted
   path and the target's token) and gives its distribution after the root;
2. it expands the tree level by level, **one forward per depth**: the
   ``beam`` best nodes of the last level (by cumulative draft probability,
   the product of the draft's probabilities along the path) are fed
   together with a tree attention mask over its own cache, and each gets
   ``width`` children: its top tokens (deterministic), or, when sampling
   with ``sample_siblings``, tokens drawn one after the other without
   replacement from its processed distribution (kept with the tree, for the
   acceptance rule).  A sampled node draws only as many children as its
   distribution's top tokens need to cover ``sibling_coverage`` of its mass
   (at most ``width``): a confident draft drafts a deep chain, an unsure
   one a wider tree;
3. the planner keeps the best nodes by cumulative probability within its
   node budget (:meth:`DraftModelTreeDrafter.select`): a node can enter only
   after its parent and its previous sibling, so the tree stays
   ancestor-closed.  Sampled siblings enter in whole groups, by their
   parent's probability (:meth:`DraftModelTreeDrafter.select_groups`): how
   many siblings a node keeps must not depend on what was drawn there, or
   recursive rejection would not be exact;
4. the draft model's cache is rolled back to the committed sequence: what it
   fed for the tree was drafts.

It needs an engine whose decoder takes tree masks (forerun's torch engine).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from forerun.decoding.draft_length import refine_seconds
from forerun.decoding.draft_tree import DraftTree, topology
from forerun.decoding.sampling import TokenSampler
from forerun.drafters.draft_context import DraftContext
from forerun.drafters.draft_model import STALE_STEP
from forerun.errors import ConfigError
from forerun.protocol.decoder import Decoder


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


class DraftModelTreeDrafter:
    """Drafts trees with its own Decoder (see the module docstring).

    ``width``: children per expanded node (at most, for sampled children);
    ``beam``: nodes expanded per level; ``sample_siblings``: when sampling,
    draw children from the draft distribution instead of taking its top
    tokens; ``sibling_coverage``: the share of a node's draft probability
    mass its sampled children's count is sized to (see
    :meth:`sibling_count`).
    """

    name = "draft-tree"
    needs_hidden = False

    def __init__(self, decoder: Decoder, *, width: int = 4, beam: int = 4,
                 sample_siblings: bool = True, sibling_coverage: float = 0.8,
                 window: int | None = None) -> None:
        if not decoder.capabilities.tree_masks:
            raise ConfigError(f"a draft model drafts trees with tree attention masks over its "
                              f"own cache, which the {decoder.engine} engine does not take; "
                              f"use the torch engine for the draft model")
        for label, value in (("width", width), ("beam", beam)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be a positive integer, got {value!r}")
        if not isinstance(sibling_coverage, (int, float)) or not 0 < sibling_coverage <= 1:
            raise ConfigError(f"sibling_coverage must be a share of probability mass in "
                              f"(0, 1], got {sibling_coverage!r}")
        self.decoder = decoder
        self.sibling_coverage = float(sibling_coverage)
        self.width = width
        self.beam = beam
        self.sample_siblings = sample_siblings
        # The committed tokens the cache holds, of the draft's view of the
        # sequence (all of it, or a long prompt cut to ``window`` tokens).
        self.context = DraftContext(decoder, window)
        self._known_committed = 0     # view length of the last committed sequence seen
        self._last_depth: int | None = None     # the last round's depth
        # Seconds of one level forward: of ``beam`` nodes (False), of a
        # chain's one node (True).
        self._level_seconds: dict[bool, float] = {}
        self._catch_up_seconds: float | None = None
        # Committed tokens fed since the last timed catch-up, across
        # generations (see expand).
        self._untimed = 0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.context.begin(prompt_ids)
        self._known_committed = 0
        self._last_depth = None

    # -- drafting ----------------------------------------------------------------
    def _feed_committed(self, todo: list[int]) -> torch.Tensor:
        """Feed ``todo``, committed tokens the cache lacks; the draft's
        logits after the last."""
        logits = self.decoder.feed(todo, last_only=True).logits[-1]
        self.context.fed.extend(todo)
        return logits

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

    def expand(self, sequence: Sequence[int], depth: int, sampler: TokenSampler, *,
               chain: bool = False) -> DraftedNodes:
        """Draft ``depth`` levels below the root ``sequence[-1]``;
        ``chain``: one child per node (a chain of ``depth`` drafts, the
        cheapest tree, which the planner drafts where a tree would not
        pay)."""
        decoder = self.decoder
        width, beam = (1, 1) if chain else (self.width, self.beam)
        # Steady drafting: the sequence grew by at most what the last round
        # could commit (its accepted path and the model's token), with no
        # plain step between.  A catch-up on more (the prompt, or the tokens
        # of plain steps) is not what a round of drafting costs: timed, it
        # made the policy believe drafting never pays, and stop drafting
        # (even exploring) for good.
        view = self.context.view(sequence)
        steady = (self._last_depth is not None
                  and len(view) - self._known_committed <= self._last_depth + 1)
        todo = self.context.catch_up(view)
        self._untimed = 0 if steady else self._untimed + len(todo)
        if not steady and len(todo) > 2 and self._untimed >= STALE_STEP:
            # No steady catch-up was timed for STALE_STEP committed tokens:
            # a policy that drafts only now and then, to explore, after
            # plain rounds, whose every round starts with a long catch-up.
            # If a stalled catch-up left the estimate too high, it would
            # stay so (and keep the policy from drafting) for good.  So the
            # committed tokens but the last go in first, and the last alone
            # is timed, as the catch-up of a steady round (which feeds no
            # fewer): one forward more, once in STALE_STEP tokens.
            self._feed_committed(todo[:-1])
            todo = todo[-1:]
            steady = True
            self._untimed = 0
        t0 = time.perf_counter()
        logits = self._feed_committed(todo)
        self._known_committed = len(view)
        self._last_depth = depth
        t1 = time.perf_counter()
        self.context.note_read(len(todo), t1 - t0)
        if steady:
            self._catch_up_seconds = refine_seconds(self._catch_up_seconds, t1 - t0)
        elif self._catch_up_seconds is not None:
            # A longer catch-up faster than the estimate shows it too high.
            self._catch_up_seconds = min(self._catch_up_seconds, t1 - t0)
        nodes = DraftedNodes()
        nodes.add(sequence[-1], -1, 1.0)
        committed = decoder.length       # the root's slot is committed - 1
        slot: dict[int, int] = {0: committed - 1}
        frontier, rows = [0], [logits]
        for level in range(1, depth + 1):
            new: list[int] = []
            for node, row in zip(frontier, rows):
                tokens, probs, drawn_from = self._children(row, sampler, width)
                if drawn_from is not None:
                    nodes.sibling_probs[node] = drawn_from
                for t in tokens:
                    new.append(nodes.add(t, node, nodes.scores[node] * float(probs[t])))
            if level == depth or not new:
                break
            frontier = heapq.nlargest(beam, new, key=lambda i: nodes.scores[i])
            frontier.sort()
            start = time.perf_counter()
            rows = self._forward(nodes, frontier, slot, committed, level)
            self._level_seconds[chain] = refine_seconds(self._level_seconds.get(chain),
                                                        time.perf_counter() - start)
        decoder.rollback(committed)      # the drafts fed for the tree
        return nodes

    def _forward(self, nodes: DraftedNodes, frontier: list[int], slot: dict[int, int],
                 committed: int, level: int) -> list[torch.Tensor]:
        """Feed ``frontier`` (nodes of one level) in one forward, each
        attending to the committed cache, its fed ancestors and itself."""
        decoder = self.decoder
        base = decoder.length
        mask = torch.zeros(len(frontier), base + len(frontier), dtype=torch.bool)
        mask[:, :committed] = True
        for i, node in enumerate(frontier):
            mask[i, base + i] = True
            parent = nodes.parents[node]
            while parent > 0:
                mask[i, slot[parent]] = True
                parent = nodes.parents[parent]
        positions = [committed - 1 + level] * len(frontier)
        out = decoder.forward([nodes.tokens[n] for n in frontier], positions,
                              mask.to(decoder.device))
        for i, node in enumerate(frontier):
            slot[node] = base + i
        return list(out.logits)

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

    # -- feedback ----------------------------------------------------------------
    def observe(self, sequence: Sequence[int], accepted: int) -> None:
        """Nothing to do: the next round feeds the committed tokens."""

    def settle(self, length: int) -> None:
        self.context.settle(min(self.context.view_length(length), self._known_committed))

    def catch_up_seconds(self, sequence: Sequence[int], rounds: int) -> float:
        """What reading the committed tokens it lacks costs a round
        (:class:`~forerun.decoding.drafter.ReadsContext`;
        :meth:`~forerun.drafters.draft_context.DraftContext.read_seconds`)."""
        return self.context.read_seconds(sequence, rounds, self.draft_seconds(1, True))

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
