"""The quick subset of the suite (``FORERUN_QUICK=1``, see the README).

* Statistical tests draw fewer samples.  Their pass thresholds stay the
  same, so they still pass on an exact algorithm; a subtly wrong one may
  slip through the smaller samples, which is why CI runs the full counts.
* Tests marked ``power`` (that a statistical test catches a broken twin of
  an algorithm) are left out: they test the tests' power at the full
  counts, which the quick subset does not draw.
* Tests marked ``builds`` (that compile the native kernels again from
  source, to test building: a damaged library, two builders at once, a
  read-only cache, a build that computes wrongly) are left out too: a few
  seconds each, and they test the build, not the numbers.
* Stress tests run fewer rounds.
* torch runs one thread per process (``OMP_NUM_THREADS=1``, set by
  ``conftest.py``), for the two workers of ``pytest -n 2``.
"""

from __future__ import annotations

import os

QUICK = os.environ.get("FORERUN_QUICK", "") not in ("", "0")

QUICK_LEAVES_OUT = ("power", "builds")


def draws(full: int, quick: int) -> int:
    """``full`` draws, or ``quick`` in the quick subset."""
    return quick if QUICK else full
