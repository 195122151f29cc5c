"""How much of a prompt a draft model reads: its window (the rule is
:class:`~forerun.drafters.draft_context.DraftContext`'s).

A window of ``W`` keeps a long prompt's first :data:`SINK_TOKENS` tokens and
its last ``W - SINK_TOKENS``; ``None`` reads the whole prompt.  Drafts stay
lossless whatever the window: the target verifies every token.  This module
imports nothing, so that options can be checked before anything loads.
"""

from __future__ import annotations

from typing import Any

#: tokens of a long prompt's start a window keeps (models attend strongly
#: to them: attention sinks, Xiao et al. 2023)
SINK_TOKENS = 4

#: the most prompt tokens a draft model reads by default, chosen from the
#: 0.5B Qwen draft's agreement with the 1.5B target against the window
#: (``benchmarks/draft_acceptance.py``, 3 bench prompts a category;
#: ``benchmarks/results/2026-11-27-draft-window.md``): 0.82 reading whole
#: prompts, 0.81 at 512, 0.76 at 256 and 0.68 at 64.  Shorter windows lose it
#: where the answer copies from a document (RAG: 0.93 whole, 0.91 at 512,
#: 0.59 at 256), and a read of 512 tokens costs about 2 s on 2 AVX2 cores,
#: which the policy pays only once the generation can pay it back
#: (:class:`~forerun.decoding.drafter.ReadsContext`).
DEFAULT_DRAFT_WINDOW = 512


def window_problem(window: Any) -> str | None:
    """What is wrong with ``window`` as a draft window (``None``: nothing):
    it must be an integer above :data:`SINK_TOKENS`, or ``None`` (the whole
    prompt)."""
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= SINK_TOKENS:
        return (f"must be an integer above {SINK_TOKENS} (the tokens it keeps of a "
                f"prompt's start)")
    return None
