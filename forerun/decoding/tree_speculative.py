"""Tree speculative decoding: the drafter proposes several candidates per
position (a tree), the target verifies the whole tree in one forward with a
tree attention mask, and only the accepted path is kept.

A round, with ``L`` positions cached (every committed token but the last,
the *root*):

1. choose a tree shape (:class:`~forerun.decoding.tree.TreePolicy`: from
   measured verification costs and the drafter's measured accuracy);
2. ask the drafter for ranked candidates per depth; node ``(r1..rd)`` gets
   the depth-``d`` candidate of rank ``rd``;
3. one target forward of ``[root, node 1, .., node N]`` at positions ``L +
   depth``, each attending to the cached prefix, its ancestors and itself;
4. acceptance (:mod:`~forerun.decoding.tree_acceptance`): greedy, lossless
   sampling over siblings, or (only when asked) Medusa's lossy typical
   acceptance;
5. the accepted path's keys and values are moved to the contiguous slots
   ``L, L+1, ..`` with ``keep_slots`` (a copy of the path's length; nothing
   is fed again), which also drops the rest of the tree.  A chain-shaped
   acceptance (nodes ``0..n-1``) is a plain O(1) rollback.  A decoder without
   ``keep_slots`` gets the path re-fed instead (the path only, never the
   prefix).

Statistics: ``rounds`` counts verifications; ``drafted`` counts the tree's
*depth* per round (the most drafted tokens a round can accept, so that
``acceptance_rate`` compares with chain speculation's, where depth = k);
``accepted`` counts accepted drafted tokens.  ``nodes_verified`` on the
method counts tree nodes.
"""

from __future__ import annotations

import time
from typing import Iterator, Protocol, Sequence

import torch

from ..decoder import Decoder
from ..errors import ConfigError
from ..stats import GenerationStats
from ..sampling import TokenSampler
from .base import DraftAndVerify
from .finite import finite
from .prefill import prefill
from .tree import TreePolicy, TreeShape, tree_shape
from .tree_acceptance import accept_tree_greedy, accept_tree_sampled, accept_tree_typical

MAX_TREE_NODES = 64


class TreeDrafter(Protocol):
    """Proposes ranked candidates per depth for a draft tree."""

    name: str
    #: whether :meth:`candidates` needs the target's hidden state
    needs_hidden: bool
    max_depth: int
    max_width: int

    def begin(self, prompt_ids: Sequence[int]) -> None:
        ...

    def rank_accuracy(self) -> list[list[float]] | None:
        """Prior hit rate of each depth's rank-r candidate, ``[depth][rank]``."""
        ...

    def candidates(self, sequence: Sequence[int], hidden: torch.Tensor | None, depth: int,
                   width: int, sampler: TokenSampler) -> list[list[int]]:
        """Up to ``width`` ranked candidates for each of the ``depth``
        positions after ``sequence``.  ``hidden``: the target's final hidden
        state of ``sequence[-2]`` (the input of Medusa heads).  Candidates
        must not depend on the target's verdict, and siblings should be
        distinct."""
        ...

    def settle(self, length: int) -> None:
        ...

    def step_seconds(self, depth: int) -> float:
        """Seconds to draft a tree of this depth."""
        ...


class TreeSpeculativeDecoding(DraftAndVerify):
    """Draft-tree-then-verify decoding over a :class:`TreeDrafter`.

    ``tree``: a fixed shape (a :class:`~forerun.decoding.tree.TreeShape` or
    rank paths) instead of choosing one per round; ``nodes``: a fixed node
    count (the best tree of that size by the measured accuracies).
    ``lossy_typical``: Medusa's typical acceptance when sampling, which is
    **not** lossless (see :mod:`~forerun.decoding.tree_acceptance`).
    """

    def __init__(self, target: Decoder, drafter: TreeDrafter, *,
                 tree: TreeShape | Sequence[Sequence[int]] | None = None,
                 nodes: int | None = None, max_nodes: int = 16,
                 lossy_typical: bool = False, typical_threshold: float = 0.09,
                 typical_alpha: float = 0.3, name: str | None = None) -> None:
        if nodes is not None and not (isinstance(nodes, int) and 1 <= nodes <= MAX_TREE_NODES):
            raise ConfigError(f"the tree's node count must be an integer in "
                              f"1..{MAX_TREE_NODES}, got {nodes!r}")
        if not 1 <= max_nodes <= MAX_TREE_NODES:
            raise ConfigError(f"max_nodes must lie in 1..{MAX_TREE_NODES}, got {max_nodes}")
        caps = target.capabilities
        if drafter.needs_hidden and not caps.hidden_states:
            raise ConfigError(f"the {drafter.name} drafter needs the target's hidden states, "
                              f"which the {target.engine} engine does not provide")
        if not caps.tree_masks:
            raise ConfigError(f"tree verification needs tree attention masks, which the "
                              f"{target.engine} engine does not take; use the torch engine")
        self.target = target
        self.drafter = drafter
        self.name = name or drafter.name
        self.fixed_tree = None if tree is None else tree_shape(tree)
        if self.fixed_tree is not None and self.fixed_tree.depth > drafter.max_depth:
            raise ConfigError(f"the tree is {self.fixed_tree.depth} deep but the drafter "
                              f"proposes at most {drafter.max_depth} positions")
        self.policy = TreePolicy(drafter.max_depth, drafter.max_width,
                                 max_nodes=max(max_nodes, nodes or 0),
                                 prior=drafter.rank_accuracy(), nodes=nodes)
        self.lossy_typical = lossy_typical
        self.typical_threshold = typical_threshold
        self.typical_alpha = typical_alpha
        self.cost_store = None   # optional: persists calibration (see api)
        self._calibrated = False
        self.nodes_verified = 0

    # -- the tree of a round -------------------------------------------------
    def _calibrate(self, token: int) -> None:
        if self._calibrated or self.fixed_tree is not None or self.policy.fixed_nodes:
            return
        self._use_stored_or_measure(lambda: self.policy.calibrate(self.target, token))

    def _shape(self, room: int, have_hidden: bool) -> TreeShape:
        if room <= 0 or (self.drafter.needs_hidden and not have_hidden):
            return tree_shape([])
        if self.fixed_tree is not None:
            shape = self.fixed_tree
            # Breadth-first order: any prefix of the nodes is a tree.
            return shape if shape.num_nodes <= room else tree_shape(shape.key[:room])
        return self.policy.choose(self.drafter.step_seconds, room)

    @staticmethod
    def _fit(shape: TreeShape, candidates: list[list[int]], vocab: int) -> TreeShape:
        """Drop the nodes the drafter gave no (valid) candidate for, and their
        subtrees."""
        valid = [[0 <= t < vocab for t in row] for row in candidates]
        if len(valid) >= shape.depth and all(
                len(valid[d]) >= w and all(valid[d][:w]) for d, w in enumerate(shape.widths)):
            return shape
        keep = [p for p in shape.key
                if all(d < len(valid) and r < len(valid[d]) and valid[d][r]
                       for d, r in enumerate(p))]
        return tree_shape(keep)

    # -- decoding ------------------------------------------------------------
    def run(self, prompt_ids: list[int], sampler: TokenSampler,
            stats: GenerationStats) -> Iterator[list[int]]:
        target, drafter = self.target, self.drafter
        want_hidden = bool(drafter.needs_hidden)
        drafter.begin(prompt_ids)
        sequence = list(prompt_ids)
        start = time.perf_counter()
        # The prefill is plain decoding's (see Decoder.feed); its logits
        # give the first token, the first root.
        out = prefill(target, sequence, return_hidden=want_hidden)
        hidden = out.hidden[-1] if want_hidden else None
        self._calibrate(sequence[-1])
        stats.prefill_seconds = time.perf_counter() - start
        stats.verify_group = target.verify_group
        first = sampler.pick(finite(out.logits[-1]))
        sequence.append(first)
        yield [first]
        vocab = target.vocab_size
        keep_slots = target.keep_slots if target.capabilities.slot_compaction else None
        device = target.device
        while True:
            room = target.context_length - target.length - 1
            shape = self._shape(room, hidden is not None)
            t0 = time.perf_counter()
            candidates: list[list[int]] = []
            if shape.num_nodes:
                candidates = drafter.candidates(sequence, hidden, shape.depth,
                                                max(shape.widths), sampler)
                shape = self._fit(shape, candidates, vocab)
            tokens = shape.tokens(sequence[-1], candidates)
            t1 = time.perf_counter()
            base = target.length
            if shape.num_nodes == 0:
                out = target.feed(tokens, return_hidden=want_hidden)
            else:
                out = target.forward(tokens, shape.positions(base, device),
                                     shape.attention_mask(base, device),
                                     return_hidden=want_hidden)
            t2 = time.perf_counter()
            logits = finite(out.logits)
            if sampler.greedy:
                path, extra = accept_tree_greedy(shape, tokens, logits)
            elif self.lossy_typical:
                path, extra = accept_tree_typical(
                    shape, tokens, _probs_of(sampler, logits), sampler.generator,
                    threshold=self.typical_threshold, alpha=self.typical_alpha)
            else:
                path, extra = accept_tree_sampled(
                    shape, tokens, _probs_of(sampler, logits), sampler.generator)
            n = len(path)
            if path == list(range(n)):
                target.rollback(base + n)        # a prefix of the fed slots
                hidden = out.hidden[path[-1]] if want_hidden else None
            elif keep_slots is not None:
                keep_slots(torch.tensor([base + i for i in path], dtype=torch.long), base)
                hidden = out.hidden[path[-1]] if want_hidden else None
            else:
                target.rollback(base)
                again = target.feed([tokens[i] for i in path], return_hidden=want_hidden)
                hidden = again.hidden[-1] if want_hidden else None
            committed = [tokens[i] for i in path[1:]] + [int(extra)]
            sequence.extend(committed)
            stats.record_round(drafted=shape.depth if shape.num_nodes else 0, accepted=n - 1,
                               draft_seconds=t1 - t0, verify_seconds=t2 - t1)
            if shape.num_nodes:
                self.nodes_verified += shape.num_nodes
                self.policy.acceptance.update(shape, path)
            self.policy.costs.observe(shape.size, t2 - t1)
            yield committed


def _probs_of(sampler: TokenSampler, logits: torch.Tensor):
    """The processed distribution of a node's row, on demand: the walk
    usually reads only a few rows, and with a large vocabulary each costs a
    sort.  (Batching the rows of a small vocabulary does not pay either: a
    multi-row softmax goes to the thread pool.)"""
    return lambda i: sampler.probs(logits[i])
