"""Acceptance rules for a verified draft tree (a chain is a tree too).

Each rule walks the tree from the root and returns the accepted path (node
indices from the root, the root included) and the one token the target adds
after it.  The target's distribution after node ``i`` is read only for the
nodes the walk reaches.

* :func:`accept_tree_greedy`: at each node, follow the child whose token is
  the target's argmax; stop where none is.  The output is token-identical to
  plain greedy decoding.
* :func:`accept_tree_sampled`: lossless sampling over the children of a
  node, tried in order, with a residual ``r`` that starts as the target's
  distribution ``p`` and is updated after each rejected child:

  - *deterministic* children (point masses: prompt lookup, suffix drafts,
    Medusa's candidates): draw ``y ~ p`` with the sampler's generator and
    follow the child whose token is ``y``; if none is, ``y`` is the added
    token.  This is SpecInfer's multi-step speculative sampling (Miao et
    al. 2024; accepting child ``x`` with probability ``r(x)``, then ``r <-
    norm(r without x)``, is the same walk in distribution), drawn so that
    each committed token is one draw from its position's ``p``, in order:
    exactly the draws plain decoding makes.  With the same seed the output
    is plain sampling's, token for token, whatever was drafted;
  - children *sampled without replacement* from the draft distribution
    ``q``: the ``i``-th was drawn from ``q_i``, which is ``q`` without the
    earlier siblings, renormalised.  Child ``x`` is accepted with
    probability ``min(1, r(x) / q_i(x))``; on rejection ``r <- norm(max(0,
    r - q_i))``.  This is recursive rejection sampling (Jeon et al. 2024,
    "Recursive Speculative Decoding"), which generalises the multi-draft
    rule of SpecInfer and of Chen et al. 2023 to draws without replacement;
    with one child it is speculative sampling (Leviathan et al. 2023, Chen
    et al. 2023).

  If every child is rejected, the added token is drawn from ``r``.  Either
  way the output has exactly the target's distribution.
* :func:`accept_tree_typical`: Medusa's *typical acceptance* (Cai et al.
  2024): a candidate passes when ``p(x) > min(threshold, alpha * exp(-H(p)))``;
  the longest passing path wins (ties: the most likely one) and the added
  token is drawn from ``p`` after it.  It accepts more, but it is **lossy**:
  the output no longer has the target's distribution.  Only used when asked
  for explicitly (``lossy_typical=True``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.sampling import sample_token

ProbsOf = Callable[[int], torch.Tensor]


def accept_tree_greedy(tree: DraftTree, argmax_of: Callable[[int], int]
                       ) -> tuple[list[int], int]:
    """``argmax_of(i)``: the target's argmax after node ``i``."""
    children, tokens = tree.shape.children, tree.tokens
    node, path = 0, [0]
    while True:
        want = int(argmax_of(node))
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return sample_token(probs.to(generator.device), generator)


def _pad(probs: torch.Tensor, width: int) -> torch.Tensor:
    if probs.shape[-1] == width:
        return probs
    return torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))


def accept_tree_sampled(tree: DraftTree, probs_of: ProbsOf, generator: torch.Generator
                        ) -> tuple[list[int], int]:
    """``probs_of(i)``: the target's processed ``[V]`` distribution after
    node ``i`` (computed only for the nodes the walk reaches)."""
    node, path = 0, [0]
    while True:
        p = probs_of(node).float()
        kids = tree.shape.children[node]
        if not kids:
            return path, _draw(p, generator)
        q = tree.sibling_probs.get(node)
        if q is None:
            y = _draw(p, generator)
            chosen = next((c for c in kids if tree.tokens[c] == y), None)
            if chosen is None:
                return path, y
        else:
            uniforms = torch.rand(len(kids), generator=generator,
                                  device=generator.device).tolist()
            chosen, residual = _walk_sampled(tree, kids, p, q, uniforms)
            if chosen is None:
                return path, _draw(residual, generator)
        path.append(chosen)
        node = chosen


def _walk_sampled(tree: DraftTree, kids: list[int], p: torch.Tensor, q: torch.Tensor,
                  uniforms: list[float]) -> tuple[int | None, torch.Tensor]:
    """Children drawn without replacement from ``q``: recursive rejection
    sampling (see the module docstring).  ``q`` is used as given for the
    first child; each later child's ``q_i`` is the previous one without the
    rejected token, rescaled to ``q``'s total."""
    width = max(p.numel(), q.numel())
    r = _pad(p, width)
    qi = _pad(q.float().to(p.device), width).clone()
    q_total = float(qi.sum())
    for c, u in zip(kids, uniforms):
        x = tree.tokens[c]
        q_sum = float(qi.sum())
        if q_sum <= 0:
            break
        scaled = qi if q_sum == q_total else qi * (q_total / q_sum)
        # u < r/q  <=>  u * q < r: no division by a zero q (such x can't be drafted).
        if u * float(scaled[x]) < float(r[x]):
            return c, r
        nxt = torch.clamp(r - scaled, min=0.0)
        total = float(nxt.sum())
        if total > 0:                   # else r <= q_i: that rejection had probability 0
            r = nxt / total
        qi[x] = 0.0                     # the next sibling was drawn without x
    head = r[:p.numel()]
    return None, head if float(head.sum()) > 0 else p


def accept_tree_typical(tree: DraftTree, probs_of: ProbsOf, generator: torch.Generator, *,
                        threshold: float = 0.09, alpha: float = 0.3
                        ) -> tuple[list[int], int]:
    """Medusa's typical acceptance (lossy; see the module docstring)."""
    cache: dict[int, tuple[torch.Tensor, float]] = {}
    children, tokens = tree.shape.children, tree.tokens

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
        if not children[node]:
            continue
        p, cut = info(node)
        for c in children[node]:
            x = tokens[c]
            px = float(p[x]) if 0 <= x < p.numel() else 0.0
            if px > cut:
                stack.append((path + [c], score + math.log(px)))
    p, _ = info(best_path[-1])
    return best_path, _draw(p, generator)
