"""The quick subset of the suite (``FORERUN_QUICK=1``, see the README):
statistical tests draw fewer samples.  Their pass thresholds stay the same,
so they still pass on an exact algorithm; a subtly wrong one may slip
through the smaller samples, which is why CI runs the full counts."""

from __future__ import annotations

import os

QUICK = os.environ.get("FORERUN_QUICK", "") not in ("", "0")


def draws(full: int, quick: int) -> int:
    """``full`` draws, or ``quick`` in the quick subset."""
    return quick if QUICK else full
