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

import torch

from forerun.decoding.draft_length import refine_seconds
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.drafters.draft_context import DraftContext
from forerun.drafters.draft_model import STALE_STEP
from forerun.drafters.method_target import MethodOptions, MethodTarget
from forerun.drafters.tree_drafting import DraftedNodes, TreeDrafting, level_mask, tree_method
from forerun.errors import ConfigError
from forerun.protocol.decoder import Decoder

__all__ = ["DraftModelTreeDrafter", "DraftedNodes"]


class DraftModelTreeDrafter(TreeDrafting):
    """Drafts trees with its own Decoder (see the module docstring; the
    options are :class:`~forerun.drafters.tree_drafting.TreeDrafting`'s, and
    ``window`` is the most prompt tokens the draft reads)."""

    name = "draft-tree"
    needs_hidden = False

    def __init__(self, decoder: Decoder, *, width: int = 4, beam: int = 4,
                 sample_siblings: bool = True, sibling_coverage: float = 0.8,
                 window: int | None = None) -> None:
        if not decoder.capabilities.tree_masks:
            raise ConfigError(f"a draft model drafts trees with tree attention masks over its "
                              f"own cache, which the {decoder.engine} engine does not take; "
                              f"use the torch engine for the draft model")
        super().__init__(width=width, beam=beam, sample_siblings=sample_siblings,
                         sibling_coverage=sibling_coverage)
        self.decoder = decoder
        # The committed tokens the cache holds, of the draft's view of the
        # sequence (all of it, or a long prompt cut to ``window`` tokens).
        self.context = DraftContext(decoder, window)
        self._known_committed = 0     # view length of the last committed sequence seen
        self._last_depth: int | None = None     # the last round's depth
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
        mask = level_mask(nodes, frontier, slot, committed, base)
        positions = [committed - 1 + level] * len(frontier)
        out = decoder.forward([nodes.tokens[n] for n in frontier], positions,
                              mask.to(decoder.device))
        for i, node in enumerate(frontier):
            slot[node] = base + i
        return list(out.logits)

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


def trees(target: MethodTarget, options: MethodOptions) -> SpeculativeDecoding:
    """A draft model's trees by its own probabilities (the registry's
    ``draft-tree``), ``options.tree_nodes`` nodes or a budget chosen every
    round."""
    drafter = DraftModelTreeDrafter(target.draft_decoder(options.draft),
                                    window=options.draft_window)
    return tree_method(target, drafter, options)
