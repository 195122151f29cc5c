"""The acceptance rules of speculative decoding, for a chain of drafts.

Given draft tokens ``d_1..d_k`` and the target's distributions ``p_1..p_{k+1}``
(row ``i`` is the target's distribution of the token after ``d_1..d_{i}``),
each rule returns how many drafts are accepted and the one token the target
adds after them.  Together they keep the output distribution exactly the
target's (Leviathan et al. 2023, Chen et al. 2023).

A chain is a draft tree with one child per node: these are the rules of
:mod:`forerun.decoding.tree_acceptance` on a chain, the very code the
verification loop runs, with the chain's arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.tree_acceptance import accept_tree_greedy, accept_tree_sampled


def accept_greedy(draft: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Accept the longest prefix of ``draft`` equal to the target's argmax;
    the added token is the target's argmax at the first mismatch (or after
    the last draft).  ``target_logits``: ``[k+1, V]``."""
    choices = target_logits.argmax(dim=-1).tolist()
    path, extra = accept_tree_greedy(DraftTree.chain(-1, draft), lambda i: choices[i])
    return len(path) - 1, extra


def accept_sampled(draft: Sequence[int], draft_probs: torch.Tensor | None,
                   target_probs: torch.Tensor, generator: torch.Generator
                   ) -> tuple[int, int]:
    """Speculative sampling.

    Draft token ``x = d_i`` is accepted with probability
    ``min(1, p_i(x) / q_i(x))``.  At the first rejection the added token is
    drawn from ``norm(max(0, p_i - q_i))``; if that residual has no mass
    (``p_i == q_i`` up to rounding) it is drawn from ``p_i``, which is then
    the same distribution.  If all drafts pass, the added token is drawn from
    ``p_{k+1}``.

    ``draft_probs``: ``[k, Vd]`` distributions the drafts were sampled from,
    or ``None`` for a deterministic drafter (each ``q_i`` is a point mass on
    ``d_i``: accept with probability ``p_i(x)``, on rejection draw from
    ``p_i`` without ``x``).  ``target_probs``: ``[k+1, Vt]``.  Vocabularies
    of different widths (padding rows) are compared on the union, with zero
    probability outside a model's own range.
    """
    if draft_probs is not None and len(draft_probs) == 0:
        draft_probs = None
    tree = DraftTree.chain(-1, draft, draft_probs)
    path, extra = accept_tree_sampled(tree, lambda i: target_probs[i], generator)
    return len(path) - 1, extra
