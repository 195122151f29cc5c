"""Measuring which verification groups an engine computes exactly.

Greedy speculative decoding is token-identical to plain decoding only if a
forward of ``T`` positions gives, for each of them, the logits that ``T``
one-position forwards give.  Whether it does depends on the kernels the
engine's library picks for ``T`` rows, which depends on the CPU (its
instruction set, llama.cpp's repacked weight layouts, torch's GEMM blocking),
the weight format, the thread count and the context length.  A rule written
down on one CPU does not hold on the next, so the engine measures it on the
machine in hand: :func:`exact_group_size` feeds real tokens one by one and
in groups, and finds the largest group size ``g`` such that every group of
``1..g`` positions is bit-identical to the one-by-one feed, at a short and at
a long context.  Verifications are then cut into forwards of at most ``g``
positions (the engine's ``verify_group``), which keeps speculative decoding
exact by construction; ``g == 1`` means no grouping is exact and
verification costs one forward per position.

The same probe answers whether a verification may run on another thread
count than plain decoding (asynchronous drafting gives the target part of
the cores): with ``threads``, the groups are computed, prompt included, on
that many threads and compared with one-by-one forwards on the decoder's
own count.  Some kernels (torch's float32 GEMM) round differently on
another count, and then no group, not even one position, is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# The largest group the probe tries: longer verifications than this are
# not worth it on the machines forerun targets.
MAX_GROUP = 16


@dataclass(frozen=True)
class GroupingResult:
    """``exact_group``: the largest exact group size (1: none above one; 0:
    not even one position, for a probe of another thread count).
    ``first_inexact``: the smallest group size that differed (``None`` if
    every size up to ``max_group`` was exact), and ``max_difference``: the
    largest logit difference it gave.  ``contexts``: the cached lengths
    probed."""

    exact_group: int
    max_group: int
    first_inexact: int | None
    max_difference: float
    contexts: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"exact_group": self.exact_group, "max_group": self.max_group,
                "first_inexact": self.first_inexact, "max_difference": self.max_difference,
                "contexts": list(self.contexts)}

    @classmethod
    def from_dict(cls, d: object) -> GroupingResult | None:
        """The result stored by :meth:`to_dict`, or ``None`` if ``d`` is not
        a valid one."""
        try:
            assert isinstance(d, dict)
            exact, top = d["exact_group"], d["max_group"]
            first, diff = d["first_inexact"], d["max_difference"]
            contexts = tuple(d["contexts"])
            ints = [exact, top, *contexts] + ([] if first is None else [first])
            assert all(isinstance(v, int) and not isinstance(v, bool) for v in ints)
            assert 0 <= exact <= top and (first is None or exact < first <= top)
            assert exact >= 1 or first == 1     # 0: one position already differed
            assert isinstance(diff, (int, float)) and not isinstance(diff, bool)
            assert 0 <= diff < 1e30       # NaN fails, and a huge int before float()
            return cls(exact, top, first, float(diff), contexts)
        except (AssertionError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        if self.exact_group == 0:
            return (f"this thread count changes the logits (by up to "
                    f"{self.max_difference:.3g}): no verification on it is exact")
        if self.max_group == 1:
            return ("the engine promises no grouping of verified positions on this device "
                    "(its kernels' rounding of a row can depend on the rows beside it): each "
                    "position is verified in a forward of its own")
        if self.exact_group == 1:
            return ("no grouping of verified positions is exact on this machine: each "
                    "position is verified in a forward of its own (exact, but speculative "
                    "decoding gains little)")
        limit = f"up to {self.exact_group} positions per forward"
        if self.first_inexact is not None:
            limit += (f" ({self.first_inexact} positions differ by up to "
                      f"{self.max_difference:.3g})")
        return f"verification is exact in groups of {limit}"


def _group_matches(decoder, base: int, tokens: Sequence[int], reference: torch.Tensor,
                   size: int) -> float:
    """The largest logit difference between one forward of ``tokens[:size]``
    at ``base`` and ``reference`` (0.0: bit-identical)."""
    decoder.rollback(base)
    got = decoder.feed(list(tokens[:size])).logits
    want = reference[:size]
    if torch.equal(got, want):
        return 0.0
    diff = (got.float() - want.float()).abs()
    diff = torch.nan_to_num(diff, nan=float("inf"))
    return max(float(diff.max()), 1e-30)


def exact_group_size(decoder, tokens: Sequence[int], *, contexts: Sequence[int],
                     max_group: int = MAX_GROUP, threads: int | None = None
                     ) -> GroupingResult:
    """Measure the largest exact verification group of ``decoder``.

    ``tokens``: real token ids, at least ``max(contexts) + max_group`` of them.
    ``contexts``: cached lengths to probe at (each is prefilled with one
    ``last_only`` feed of ``tokens[:c]``, as a generation prefills its
    prompt).  ``threads``: compute the prefill and the groups on this many
    threads (:meth:`~forerun.protocol.decoder.Decoder.set_threads`, from the calling
    thread), the one-by-one reference on the decoder's current count; groups
    of one position are then probed too.  The decoder's ``verify_group`` is
    lifted while probing and restored afterwards, as is its thread count;
    its cache is reset.
    """
    contexts = tuple(sorted({int(c) for c in contexts if c > 0}))
    room = decoder.context_length
    contexts = tuple(c for c in contexts if c + max_group <= room) or (1,)
    if len(tokens) < max(contexts) + max_group:
        raise ValueError(f"the probe needs {max(contexts) + max_group} tokens, "
                         f"got {len(tokens)}")
    saved, own_threads = decoder.verify_group, decoder.threads
    decoder.verify_group = None
    exact = max_group
    first_bad: int | None = None
    worst = 0.0
    try:
        for c in contexts:
            decoder.reset()
            decoder.feed(list(tokens[:c]), last_only=True)
            probe = tokens[c:c + max_group]
            reference = torch.cat([decoder.feed([t]).logits for t in probe])
            if threads is not None:
                decoder.set_threads(threads)
                decoder.reset()
                decoder.feed(list(tokens[:c]), last_only=True)
            for size in range(1 if threads is not None else 2, exact + 1):
                diff = _group_matches(decoder, c, probe, reference, size)
                if diff:
                    exact = size - 1
                    if first_bad is None or size <= first_bad:
                        first_bad, worst = size, diff
                    break
            if threads is not None:
                decoder.set_threads(own_threads)
            if exact == 0:
                break
    finally:
        decoder.verify_group = saved
        if decoder.threads != own_threads:
            decoder.set_threads(own_threads)
        decoder.reset()
    return GroupingResult(exact, max_group, first_bad, worst, contexts)
