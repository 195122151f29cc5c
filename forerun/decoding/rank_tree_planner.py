"""Trees of rank paths (Medusa's heads), and the choice of such a tree for
the hardware.

Shape
-----
Medusa's heads propose ranked candidates per depth, independent of the
parent: a tree is then identified by the *rank paths* of its nodes
(Medusa's "choices"):
node ``(r1, r2, .., rd)`` sits at depth ``d`` and holds the ``rd``-th
candidate for depth ``d`` of the drafter, below node ``(r1, .., r(d-1))``.
The root ``()`` is the last committed token (fed at the head of every
verification, as in chain speculative decoding).  Nodes are numbered in
breadth-first order (by depth, then rank path), so a parent always precedes
its children and every root-to-node path is strictly ascending, which is what
:meth:`~forerun.protocol.kv_cache.KVCache.move` needs to compact an accepted path.

A :class:`TreeShape` is a
:class:`~forerun.decoding.draft_tree.TreeTopology` (parents, mask, depths:
what verification feeds) that also knows its rank paths; :func:`tree_shape`
builds each once.

Choosing the tree on a CPU
--------------------------
GPU Medusa trees have 60-ish nodes because a GPU verifies 64 positions for
the price of one.  A 2-core CPU does not: a forward of ``T`` positions costs
about ``T=1: 1, T=2: 1.5, T=4: 1.8, T=8: 3.6, T=16: 4.6`` times a single one
(llama.cpp on the 1.5B, ``MEASUREMENTS.md``; forerun's fp32 engine is
similar: GEMM ``M=2 ~ M=1``, ``M=4 ~ 1.9x``, ``M=8 ~ 2.7x``).  So the tree is
chosen every round from measured costs and measured accuracies:

* ``VerifyCosts`` (the same estimator as the draft length of chain
  speculative decoding) holds the seconds of a target forward of ``T``
  positions, calibrated at start (a few sizes, kept per machine) and refined
  by every round.
* :class:`RankAcceptance` holds, for each depth ``d`` and rank ``r``, the
  probability that the drafter's rank-``r`` candidate at depth ``d`` is the
  token the target takes, given the path above it was taken.  It starts
  from the heads' held-out hit rates (stored with the heads by training) and
  follows the observed rounds (a decayed count).
* Assuming independence across depths, node ``(r1..rd)`` is accepted with
  probability ``prod_j a[j][rj]``, and a round commits ``1 + sum`` of these
  over the tree's nodes on average (siblings exclude each other).
  :func:`grow_tree` adds nodes best-first by that probability (Medusa's
  "optimal sparse tree" construction), giving the best tree of every size
  ``N`` at once; the policy takes the ``N`` that maximises expected tokens
  per second, ``(1 + E_N) / (t_verify(N + 1) + t_draft(depth))``.

What this picks here.  Measured on this 2-core machine with forerun's fp32
engine on the 1.5B preset (calm machine): a forward of T = 1, 2, 3, 4, 6, 8
positions takes 0.21, 0.23, 0.24, 0.43, 0.45, 0.65 s: up to 3 positions are
almost free, the 4th doubles the cost.  The shipped heads (trained on 16k
tokens on this CPU) guess the next-but-one token with top-1 ~0.17-0.25 and
top-2 ~0.08 (head 0); the heads for t+3 and t+4 are right < 5% of the time.
So the policy settles on one- or two-node trees at depth 1 (the head's top-1
and top-2 guesses: ``[(0,)]`` or ``[(0,), (1,)]``), sometimes three
siblings, and a plain step when the heads keep missing; it never verifies a
GPU-sized tree, and deeper trees appear only with better heads (higher
accuracies make deeper nodes' path probabilities worth their cost).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, cast

import torch

from forerun.decoding.base import check_count
from forerun.decoding.draft_length import OPTIMISTIC_ACCEPTANCE, Exploration, VerifyCosts
from forerun.decoding.draft_tree import DraftTree, TreeTopology
from forerun.decoding.limits import MAX_TREE_NODES
from forerun.decoding.sampling import TokenSampler
from forerun.errors import ConfigError

RankPath = tuple[int, ...]


class TreeShape(TreeTopology):
    """A tree of rank paths (Medusa's "choices"); see the module docstring.

    ``paths[i]``: rank path of node ``i`` (node 0 is the root, ``()``).
    ``ranks[i]``: its rank among its siblings.  ``widths[d]``: candidates
    needed at depth ``d + 1``.  ``leaf_paths``: node indices from the root
    to each leaf.  The topology (parents, depths, mask) is
    :class:`~forerun.decoding.draft_tree.TreeTopology`'s.
    """

    def __init__(self, paths: Iterable[Sequence[int]]) -> None:
        found: set[RankPath] = set()
        for p in paths:
            path = tuple(int(r) for r in p)
            if not path:
                continue   # the root is always there
            if min(path) < 0:
                raise ConfigError(f"tree path {path} has a negative rank")
            for d in range(1, len(path) + 1):   # every prefix is a node too
                found.add(path[:d])
        nodes: list[RankPath] = [()] + sorted(found, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(nodes)}
        super().__init__([-1] + [index[p[:-1]] for p in nodes[1:]])
        self.paths = nodes
        self.key = tuple(nodes[1:])
        self.ranks = [-1] + [p[-1] for p in nodes[1:]]
        #: candidates needed per depth: 1 + the largest rank used there
        self.widths = [0] * self.depth
        for p in nodes[1:]:
            self.widths[len(p) - 1] = max(self.widths[len(p) - 1], p[-1] + 1)
        self.leaves = [i for i in range(len(nodes)) if not self.children[i]]
        self.leaf_paths = [self.path_nodes(i) for i in self.leaves]

    def __repr__(self) -> str:
        return f"TreeShape({list(self.key)})"

    def tokens(self, root: int, candidates: Sequence[Sequence[int]]) -> list[int]:
        """Token of every node: the root, then ``candidates[d - 1][r]`` for a
        node of depth ``d`` and rank ``r``."""
        out = [int(root)]
        for p in self.paths[1:]:
            out.append(int(candidates[len(p) - 1][p[-1]]))
        return out

    # -- common shapes ------------------------------------------------------
    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """The top-1 candidate of depths ``1..k``: chain speculation."""
        return tree_shape([(0,) * k] if k > 0 else [])

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> TreeShape:
        """Every combination: ``counts[d]`` children under each node of depth
        ``d`` (``[2, 2, 1]`` has 2 + 4 + 4 nodes)."""
        paths: list[RankPath] = [()]
        out: list[RankPath] = []
        for c in counts:
            if int(c) < 1:
                raise ConfigError(f"candidate counts must be >= 1, got {list(counts)}")
            paths = [p + (r,) for p in paths for r in range(int(c))]
            out += paths
        return tree_shape(out)


_SHAPES: dict[tuple, TreeShape] = {}
_MAX_CACHED = 256


def tree_shape(paths: Iterable[Sequence[int]] | TreeShape) -> TreeShape:
    """The :class:`TreeShape` of ``paths``, built once and then reused."""
    if isinstance(paths, TreeShape):
        return paths
    shape = TreeShape(paths)
    cached = _SHAPES.get(shape.key)
    if cached is not None:
        return cached
    if len(_SHAPES) >= _MAX_CACHED:
        _SHAPES.pop(next(iter(_SHAPES)))
    _SHAPES[shape.key] = shape
    return shape


# -- choosing the tree ----------------------------------------------------------

def default_prior(depths: int, width: int) -> list[list[float]]:
    """Per-depth, per-rank acceptance guesses for a drafter that recorded none."""
    return [[0.6 * 0.75 ** d * 0.4 ** r for r in range(width)] for d in range(depths)]


class RankAcceptance:
    """Decayed hit counts per (depth, rank): how often the drafter's rank-r
    candidate at depth d was the token the target took, among rounds where
    that candidate was in the tree and its parent was accepted."""

    def __init__(self, depths: int, width: int, prior: Sequence[Sequence[float]] | None = None,
                 weight: float = 10.0, decay: float = 0.99) -> None:
        base = default_prior(depths, width)
        if prior:
            for d in range(min(depths, len(prior))):
                for r in range(min(width, len(prior[d]))):
                    base[d][r] = min(0.98, max(1e-3, float(prior[d][r])))
        self.hits = [[p * weight for p in row] for row in base]
        self.trials = [[weight] * width for _ in range(depths)]
        self.decay = decay

    @property
    def depths(self) -> int:
        return len(self.hits)

    @property
    def width(self) -> int:
        return len(self.hits[0]) if self.hits else 0

    def rate(self, depth: int, rank: int) -> float:
        """Acceptance probability of the rank-``rank`` candidate at depth
        ``depth`` (1-based)."""
        return self.hits[depth - 1][rank] / self.trials[depth - 1][rank]

    def rates(self) -> list[list[float]]:
        return [[h / t for h, t in zip(hr, tr)] for hr, tr in zip(self.hits, self.trials)]

    def update(self, shape: TreeShape, path: Sequence[int]) -> None:
        """Record a round: ``path`` is the accepted node path (from the root)."""
        for j, node in enumerate(path):
            kids = shape.children[node]
            if not kids:
                break
            taken = path[j + 1] if j + 1 < len(path) else None
            d = shape.depths[node]            # children are at depth d + 1
            if d >= self.depths:
                break
            for c in kids:
                r = shape.ranks[c]
                if r >= self.width:
                    continue
                self.hits[d][r] = self.hits[d][r] * self.decay + (1.0 if c == taken else 0.0)
                self.trials[d][r] = self.trials[d][r] * self.decay + 1.0


def grow_tree(rates: Sequence[Sequence[float]], max_nodes: int
              ) -> tuple[list[RankPath], list[float]]:
    """Nodes best-first by acceptance probability: the first ``N`` of the
    returned paths are the best tree of ``N`` nodes (under independence),
    for every ``N``.  Returns the paths and each one's probability."""
    depths = len(rates)
    if depths == 0 or max_nodes <= 0:
        return [], []
    width = len(rates[0])
    order: list[RankPath] = []
    probs: list[float] = []
    # Frontier: (-probability, path).  A node enters once its parent and its
    # next-better sibling are in the tree.
    heap: list[tuple[float, RankPath]] = [(-rates[0][0], (0,))]
    while heap and len(order) < max_nodes:
        negp, path = heapq.heappop(heap)
        p = -negp
        order.append(path)
        probs.append(p)
        d, r = len(path), path[-1]
        if r + 1 < width:
            parent = p / rates[d - 1][r] if rates[d - 1][r] > 0 else 0.0
            heapq.heappush(heap, (-parent * rates[d - 1][r + 1], path[:-1] + (r + 1,)))
        if d < depths:
            heapq.heappush(heap, (-p * rates[d][0], path + (0,)))
    return order, probs


class TreePolicy:
    """Chooses the draft tree every round; see the module docstring.

    ``nodes``: a fixed node count (the best tree of that size) instead of the
    cost-based choice.  It explores as
    :class:`~forerun.decoding.draft_length.Exploration` says: one node every
    ``explore_every`` plain rounds in a row where a tree could pay at all,
    and one node more than chosen every ``stale_every`` rounds.
    """

    def __init__(self, depths: int, width: int, *, max_nodes: int = 16,
                 prior: Sequence[Sequence[float]] | None = None, nodes: int | None = None,
                 explore_every: int = 8, stale_every: int = 64) -> None:
        self.max_nodes = max_nodes
        self.fixed_nodes = nodes
        self.costs = VerifyCosts(max_nodes + 1)
        self.acceptance = RankAcceptance(depths, width, prior)
        self.exploration = Exploration(explore_every, stale_every)

    def choose(self, draft_seconds: Callable[[int], float], room: int) -> TreeShape:
        limit = min(self.max_nodes, room)
        if self.fixed_nodes is not None:
            limit = min(limit, self.fixed_nodes)
        order, probs = grow_tree(self.acceptance.rates(), limit)
        if self.fixed_nodes is not None:
            return tree_shape(order)
        best_n, best_rate, expected, depth = 0, 0.0, 1.0, 0
        rate0 = 1.0 / max(self.costs(1), 1e-9)
        best_rate = rate0
        for n in range(1, len(order) + 1):
            expected += probs[n - 1]
            depth = max(depth, len(order[n - 1]))
            cost = self.costs(n + 1) + draft_seconds(depth)
            rate = expected / cost if cost > 0 else 0.0
            if rate > best_rate * 1.0001:
                best_n, best_rate = n, rate
        # Explore only where drafting could pay at all (as the chain policy
        # does): a one-node tree accepted as often as a good drafter manages
        # on easy text must beat a plain step.
        def could_pay() -> bool:
            cost = self.costs(2) + draft_seconds(len(order[0]))
            return cost > 0 and (1.0 + OPTIMISTIC_ACCEPTANCE) / cost > rate0

        best_n = min(len(order), self.exploration.adjust(best_n, could_pay)) if order else 0
        return tree_shape(order[:best_n])

    def calibrate(self, decoder, token: int, sizes: Sequence[int] = (1, 2, 3, 4, 6, 8)
                  ) -> None:
        """Time target forwards of a few sizes at the decoder's current
        length, then roll back (:meth:`VerifyCosts.calibrate`)."""
        self.costs.calibrate(decoder, token, sizes=sizes)


# -- drafters of ranked candidates ------------------------------------------------

class RankDrafter(Protocol):
    """Proposes ranked candidates per depth, independent of the parent
    (Medusa heads)."""

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


class RankTreePlanner:
    """A :class:`RankDrafter` with :class:`TreePolicy`: the
    :class:`~forerun.decoding.speculative.Planner` of Medusa heads.

    ``tree``: a fixed shape (a :class:`TreeShape` or rank paths) instead of
    choosing one per round; ``nodes``: a fixed node count (the best tree of
    that size by the measured accuracies).
    """

    drafts_trees = True
    wants_confidence = False

    def __init__(self, drafter: RankDrafter, *,
                 tree: TreeShape | Sequence[Sequence[int]] | None = None,
                 nodes: int | None = None, max_nodes: int = 16) -> None:
        if nodes is not None:
            check_count("the tree's node count", nodes, MAX_TREE_NODES)
        check_count("max_nodes", max_nodes, MAX_TREE_NODES)
        self.drafter = drafter
        self.name = drafter.name
        self.needs_hidden = bool(drafter.needs_hidden)
        self.hidden_layers: tuple[int, ...] = ()
        self.fixed_tree = None if tree is None else tree_shape(tree)
        if self.fixed_tree is not None and self.fixed_tree.depth > drafter.max_depth:
            raise ConfigError(f"the tree is {self.fixed_tree.depth} deep but the drafter "
                              f"proposes at most {drafter.max_depth} positions")
        self.policy = TreePolicy(drafter.max_depth, drafter.max_width,
                                 max_nodes=max(max_nodes, nodes or 0),
                                 prior=drafter.rank_accuracy(), nodes=nodes)

    def needs_calibration(self) -> bool:
        return self.fixed_tree is None and not self.policy.fixed_nodes

    def calibrate(self, target, token: int) -> None:
        self.policy.calibrate(target, token)

    def begin(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> None:
        self.drafter.begin(prompt_ids)

    def _shape(self, room: int, have_hidden: bool) -> TreeShape:
        if room <= 0 or (self.needs_hidden and not have_hidden):
            return tree_shape([])
        if self.fixed_tree is not None:
            shape = self.fixed_tree
            # Breadth-first order: any prefix of the nodes is a tree.
            return shape if shape.num_nodes <= room else tree_shape(shape.key[:room])
        return self.policy.choose(self.drafter.step_seconds, room)

    @staticmethod
    def _fit(shape: TreeShape, candidates: list[list[int]]) -> TreeShape:
        """Drop the nodes the drafter gave no candidate for, and their
        subtrees."""
        if len(candidates) >= shape.depth and all(
                len(candidates[d]) >= w for d, w in enumerate(shape.widths)):
            return shape
        return tree_shape([p for p in shape.key
                           if all(d < len(candidates) and r < len(candidates[d])
                                  for d, r in enumerate(p))])

    def draft(self, sequence: Sequence[int], hidden: torch.Tensor | None, room: int,
              sampler: TokenSampler) -> DraftTree:
        shape = self._shape(room, hidden is not None)
        candidates: list[list[int]] = []
        if shape.num_nodes:
            candidates = self.drafter.candidates(sequence, hidden, shape.depth,
                                                 max(shape.widths), sampler)
            shape = self._fit(shape, candidates)
        return DraftTree(shape, shape.tokens(sequence[-1], candidates))

    def learn(self, sequence: Sequence[int], tree: DraftTree, path: list[int],
              confidence: Sequence[float] | None = None) -> None:
        if tree.num_nodes:
            # the tree this planner drafted: its shape is a TreeShape
            self.policy.acceptance.update(cast(TreeShape, tree.shape), path)

    def settle(self, length: int) -> None:
        self.drafter.settle(length)

