"""How forerun's OpenMP threads wait: spinning on an idle machine, sleeping
on a busy one.

torch's and forerun's native kernels share one OpenMP runtime (libgomp),
whose threads spin-wait at the end of each parallel region.  On an idle
machine that is what makes a decode step fast.  Beside a busy core it
collapses: a thread spins on a core its partner needs, every one of the
hundreds of parallel regions of a token waits a scheduler time slice, and
the 1.5B decoded at a quarter of its idle speed (3.4 against 13.4 tok/s on
a 2-core EPYC; with ``OMP_WAIT_POLICY=passive``, 8.1 and 11.9).

libgomp reads its wait policy once, when it is loaded (``import torch``),
so the choice is made then: :func:`choose_wait_policy`, called when forerun
is imported, looks at the machine for 0.1 s and sets
``OMP_WAIT_POLICY=passive`` when other processes hold a quarter of a core
or more.  It leaves everything alone when torch is already imported (too
late to matter), when the user set ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT``, and when ``FORERUN_OMP_DEFAULTS=0``.  A machine that
becomes busy later keeps the policy chosen here; a server follows the load
with its thread count instead (:mod:`forerun.api.busy_threads`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

from forerun.machine.machine_load import conditions_now

# The variables by which a user (or a parent process) has chosen already.
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SWITCH = "FORERUN_OMP_DEFAULTS"
LOOK_SECONDS = 0.1


def choose_wait_policy(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``OMP_WAIT_POLICY=passive`` in ``environ`` (default
    ``os.environ``) when the machine is busy now and nothing else decides;
    return the policy set, or None when it left the environment alone."""
    env = os.environ if environ is None else environ
    if env.get(SWITCH, "") == "0" or any(name in env for name in USER_CHOICES):
        return None
    if "torch" in sys.modules:
        return None
    seen = conditions_now(LOOK_SECONDS)
    if not seen.busy:
        return None
    env["OMP_WAIT_POLICY"] = "passive"
    logging.getLogger("forerun.machine.wait_policy").info(
        "the machine is busy (%s): forerun's threads will sleep, not spin, while they "
        "wait (OMP_WAIT_POLICY=passive)", seen.describe())
    return "passive"
