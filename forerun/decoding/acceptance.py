"""The acceptance rules of speculative decoding.

Given draft tokens ``d_1..d_k`` and the target's distributions ``p_1..p_{k+1}``
(row ``i`` is the target's distribution of the token after ``d_1..d_{i}``),
each rule returns how many drafts are accepted and the one token the target
adds after them.  Together they keep the output distribution exactly the
target's (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from typing import Sequence

import torch


def accept_greedy(draft: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Accept the longest prefix of ``draft`` equal to the target's argmax;
    the added token is the target's argmax at the first mismatch (or after
    the last draft).  ``target_logits``: ``[k+1, V]``."""
    choices = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == choices[n]:
        n += 1
    return n, int(choices[n])


def _pad(probs: torch.Tensor, width: int) -> torch.Tensor:
    if probs.shape[-1] == width:
        return probs
    return torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))


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
    k = len(draft)
    width = target_probs.shape[-1]
    if draft_probs is not None:
        width = max(width, draft_probs.shape[-1])
        draft_probs = _pad(draft_probs.float(), width)
    target_probs = _pad(target_probs.float(), width)
    if k:
        uniforms = torch.rand(k, generator=generator, device=generator.device).to(
            target_probs.device)
        idx = torch.as_tensor(list(draft), device=target_probs.device)
        rows = torch.arange(k, device=target_probs.device)
        p_x = target_probs[rows, idx]
        q_x = draft_probs[rows, idx] if draft_probs is not None else torch.ones_like(p_x)
        # u < p/q  <=>  u * q < p: no division by a zero q (such x can't be drafted).
        accepted = (uniforms * q_x < p_x).tolist()
    else:
        accepted = []
    for i in range(k):
        if not accepted[i]:
            p = target_probs[i]
            if draft_probs is not None:
                residual = torch.clamp(p - draft_probs[i], min=0.0)
            else:
                residual = p.clone()
                residual[draft[i]] = 0.0
            total = float(residual.sum())
            probs = residual / total if total > 0 else p
            return i, _draw(probs, generator)
    return k, _draw(target_probs[k], generator)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.to(generator.device), 1, generator=generator))
