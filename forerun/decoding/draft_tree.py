"""One draft structure for every drafter: a token tree with parent pointers.

Node 0 is the *root*: the last committed token, fed at the head of every
verification.  Every other node ``i`` holds a drafted token and its parent
``parents[i] < i``, so nodes are in topological order and every
root-to-node path is strictly ascending (what
:meth:`~forerun.protocol.kv_cache.KVCache.move` needs to compact an accepted path).
A chain is a tree with one child per node: ``parents = (-1, 0, 1, .., k-1)``.

Each node's children are tried in order by the acceptance rule
(:mod:`forerun.decoding.tree_acceptance`).  How they were drafted decides
the rule:

* *deterministic* children (a draft model's top choices, prompt lookup,
  Medusa heads): each is a point mass;
* *sampled* children: drawn one after the other **without replacement**
  from the draft distribution ``q`` at their parent, kept in
  ``DraftTree.sibling_probs[parent]``; a chain drafted by sampling is the
  case of one child per node.

Everything a verification needs from the shape is computed once per shape
and reused (:func:`topology` caches them, as Medusa caches its buffers):
the ancestor mask, each node's depth (its position id is ``length +
depth``) and children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from forerun.errors import ConfigError


class TreeTopology:
    """The shape of a draft tree; see the module docstring.

    ``parents[i]``: node ``i``'s parent (``-1`` for the root).
    ``depths[i]``: its distance from the root.  ``children[i]``: child
    indices in the order they are tried.  ``tree_mask``: bool ``[size,
    size]``, ``[i, j]`` True when node ``j`` is ``i`` or one of its
    ancestors.
    """

    def __init__(self, parents: Sequence[int]) -> None:
        parents = tuple(int(p) for p in parents)
        if not parents or parents[0] != -1:
            raise ConfigError(f"a draft tree's node 0 is its root (parent -1), got {parents}")
        for i, p in enumerate(parents[1:], 1):
            if not 0 <= p < i:
                raise ConfigError(f"node {i}'s parent must be an earlier node, got {p}")
        self.parents = parents
        self.depths = [0] * len(parents)
        self.children: list[list[int]] = [[] for _ in parents]
        for i, p in enumerate(parents[1:], 1):
            self.depths[i] = self.depths[p] + 1
            self.children[p].append(i)
        self.depth = max(self.depths)
        self.is_chain = all(p == i - 1 for i, p in enumerate(parents[1:], 1))
        mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
        for i in range(len(parents)):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = parents[j]
        self.tree_mask = mask
        self.depth_ids = torch.tensor(self.depths, dtype=torch.long)
        self._on_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def size(self) -> int:
        """Positions a verification feeds: the root plus every node."""
        return len(self.parents)

    @property
    def num_nodes(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.parents) - 1

    def path_nodes(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def _buffers(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (self.tree_mask.to(device), self.depth_ids.to(device))
        return self._on_device[key]

    def attention_mask(self, prefix: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool ``[size, prefix + size]`` in the Decoder.forward convention:
        every node sees the whole cached prefix, itself and its ancestors."""
        tree, _ = self._buffers(device)
        if prefix == 0:
            return tree
        return torch.cat([torch.ones(self.size, prefix, dtype=torch.bool, device=device),
                          tree], dim=1)

    def positions(self, start: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Position ids: ``start + depth`` (siblings share a position)."""
        _, depths = self._buffers(device)
        return depths + start

    def __repr__(self) -> str:
        return f"TreeTopology({list(self.parents)})"


_TOPOLOGIES: dict[tuple[int, ...], TreeTopology] = {}
_MAX_CACHED = 512


def topology(parents: Sequence[int]) -> TreeTopology:
    """The :class:`TreeTopology` of ``parents``, built once and then reused."""
    key = tuple(int(p) for p in parents)
    cached = _TOPOLOGIES.get(key)
    if cached is None:
        cached = TreeTopology(key)
        if len(_TOPOLOGIES) >= _MAX_CACHED:
            _TOPOLOGIES.pop(next(iter(_TOPOLOGIES)))
        _TOPOLOGIES[key] = cached
    return cached


def chain_topology(k: int) -> TreeTopology:
    """A chain of ``k`` drafted nodes below the root."""
    return topology((-1,) + tuple(range(k)))


@dataclass
class DraftTree:
    """Drafted tokens in a tree: ``tokens[i]`` is node ``i``'s token
    (``tokens[0]``, the root, is the last committed token).

    ``sibling_probs[p]``: the draft distribution (``[V]``, processed like
    the target's) that node ``p``'s children were sampled from, without
    replacement, in child order.  A parent that is not a key has
    deterministic children.
    """

    shape: TreeTopology
    tokens: list[int]
    sibling_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.tokens) != self.shape.size:
            raise ConfigError(f"a tree of {self.shape.size} nodes needs {self.shape.size} "
                              f"tokens, got {len(self.tokens)}")

    @classmethod
    def chain(cls, root: int, tokens: Sequence[int],
              probs: torch.Tensor | None = None) -> DraftTree:
        """The chain ``root, tokens[0], ..``; ``probs[i]``: the distribution
        ``tokens[i]`` was sampled from (``None``: deterministic drafts)."""
        siblings = {} if probs is None else {i: probs[i] for i in range(len(tokens))}
        return cls(chain_topology(len(tokens)), [int(root)] + [int(t) for t in tokens],
                   siblings)

    @property
    def num_nodes(self) -> int:
        return self.shape.num_nodes

    @property
    def depth(self) -> int:
        return self.shape.depth

    def feedable(self, vocab: int) -> list[int]:
        """The nodes a verification feeds: those whose token, and every
        ancestor's, lies in ``0..vocab-1`` (a draft vocabulary may be wider
        than the target's).  A node outside is still tried by the acceptance
        rule, where it is always rejected, which a sampled sibling's residual
        needs; its descendants can never be reached."""
        ok = [True] * self.shape.size
        out = [0]
        for i in range(1, self.shape.size):
            ok[i] = ok[self.shape.parents[i]] and 0 <= self.tokens[i] < vocab
            if ok[i]:
                out.append(i)
        return out

    def subtree(self, nodes: Sequence[int]) -> TreeTopology:
        """The topology of ``nodes`` (ancestor-closed, ascending, root
        first), renumbered ``0..len(nodes)-1``."""
        index = {n: i for i, n in enumerate(nodes)}
        return topology([-1] + [index[self.shape.parents[n]] for n in nodes[1:]])
