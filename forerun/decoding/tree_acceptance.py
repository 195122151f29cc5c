"""Acceptance rules for a verified draft tree.

Each rule walks the tree from the root and returns the accepted path (node
indices from the root, the root included) and the one token the target adds
after it.  Row ``i`` of the target's logits is the distribution of the token
that follows node ``i``.

* :func:`accept_tree_greedy`: at each node, follow the child whose token is
  the target's argmax; stop where none is.  The output is token-identical to
  plain greedy decoding.
* :func:`accept_tree_sampled`: lossless sampling over sibling candidates
  (SpecInfer's multi-step speculative sampling, Miao et al. 2024, with
  deterministic candidates).  At a node with target distribution ``p``, the
  children are tried in rank order: child ``x`` is accepted with probability
  ``r(x) / sum(r)`` where ``r`` is the residual, initially ``p``; after each
  rejection ``r(x) = 0``.  If every child is rejected the added token is
  drawn from ``r``.  Each candidate is a point mass, so this is the rule
  ``accept x with probability min(1, r(x) / q(x))``, ``r <- norm(max(0, r -
  q))`` with ``q = delta_x``, and its output has exactly the distribution
  ``p``: the walk is the same as drawing ``y ~ p`` and following the child
  whose token is ``y`` if there is one.
* :func:`accept_tree_typical`: Medusa's *typical acceptance* (Cai et al.
  2024): a candidate passes when ``p(x) > min(threshold, alpha * exp(-H(p)))``;
  the longest passing path wins (ties: the most likely one) and the added
  token is drawn from ``p`` after it.  It accepts more, but it is **lossy**:
  the output no longer has the target's distribution.  Only used when asked
  for explicitly (``lossy_typical=True``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .tree import TreeShape

ProbsOf = Callable[[int], torch.Tensor]


def accept_tree_greedy(shape: TreeShape, tokens: Sequence[int], logits: torch.Tensor
                       ) -> tuple[list[int], int]:
    """``logits``: ``[shape.size, V]``, one row per node."""
    choice = logits.argmax(dim=-1).tolist()
    node, path = 0, [0]
    while True:
        want = int(choice[node])
        nxt = next((c for c in shape.children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.to(generator.device), 1, generator=generator))


def accept_tree_sampled(shape: TreeShape, tokens: Sequence[int], probs_of: ProbsOf,
                        generator: torch.Generator) -> tuple[list[int], int]:
    """``probs_of(i)``: the target's processed ``[V]`` distribution after
    node ``i`` (computed only for the nodes the walk reaches)."""
    node, path = 0, [0]
    while True:
        p = probs_of(node).float()
        kids = shape.children[node]
        if not kids:
            return path, _draw(p, generator)
        width = p.numel()
        xs = [tokens[c] for c in kids]
        inside = [x for x in xs if 0 <= x < width]
        mass = dict(zip(inside, p[inside].tolist())) if inside else {}
        uniforms = torch.rand(len(kids), generator=generator,
                              device=generator.device).tolist()
        total = float(p.sum())
        zeroed: list[int] = []
        chosen = None
        for c, x, u in zip(kids, xs, uniforms):
            px = mass.get(x, 0.0)
            if u * total < px:
                chosen = c
                break
            if px > 0:                      # reject x: r <- r without x
                total -= px
                mass[x] = 0.0
                zeroed.append(x)
        if chosen is None:
            residual = p
            if zeroed:
                residual = p.clone()
                residual[zeroed] = 0.0
                if float(residual.sum()) <= 0:   # rounding: p had no other mass
                    residual = p
            return path, _draw(residual, generator)
        path.append(chosen)
        node = chosen


def accept_tree_typical(shape: TreeShape, tokens: Sequence[int], probs_of: ProbsOf,
                        generator: torch.Generator, *, threshold: float = 0.09,
                        alpha: float = 0.3) -> tuple[list[int], int]:
    """Medusa's typical acceptance (lossy; see the module docstring)."""
    cache: dict[int, tuple[torch.Tensor, float]] = {}

    def info(i: int) -> tuple[torch.Tensor, float]:
        if i not in cache:
            p = probs_of(i).float()
            entropy = float(-(p * torch.log(p.clamp_min(1e-30))).sum())
            cache[i] = (p, min(threshold, alpha * math.exp(-entropy)))
        return cache[i]

    best_path, best_score = [0], 0.0
    stack: list[tuple[list[int], float]] = [([0], 0.0)]
    while stack:
        path, score = stack.pop()
        if len(path) > len(best_path) or (len(path) == len(best_path) and score > best_score):
            best_path, best_score = path, score
        node = path[-1]
        if not shape.children[node]:
            continue
        p, cut = info(node)
        for c in shape.children[node]:
            x = tokens[c]
            px = float(p[x]) if 0 <= x < p.numel() else 0.0
            if px > cut:
                stack.append((path + [c], score + math.log(px)))
    p, _ = info(best_path[-1])
    return best_path, _draw(p, generator)
