"""Python's cyclic garbage collector in a ``forerun`` command's process.

``import torch`` leaves about a million objects behind (modules, functions,
operator schemas) that live until the process ends.  The cyclic collector
walks every one of them in each full collection: three ran during a cached
``forerun generate -n 1``, 0.02 to 0.12 s each on a 2-core EPYC, and the
interpreter's shutdown walked them again: 0.5 to 0.9 s between the last
line printed and the process's end, 0.15 to 0.2 s with the freezes below.
So a command that imports torch:

* holds the collector off while torch imports, then freezes everything
  alive (:func:`gc.freeze`: moved to the permanent generation, which no
  collection walks) and turns it back on (:func:`frozen_imports`);
* freezes again when the interpreter exits (an :mod:`atexit` function), so
  that its shutdown walks nothing (:func:`freeze_at_exit`).

What runs and what is printed stay the same: a frozen object is still
freed by reference counting the moment its last reference goes; only one
that ends in a reference cycle stays (objects alive at those two moments,
torch's own for the most part).  A process that had imported torch before
(a test calling :func:`forerun.cli.main.main`) or that turned the collector
off keeps its collector as it was; only the exit freeze applies there.
"""

from __future__ import annotations

import atexit
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_exit_freeze = {"registered": False}


@contextmanager
def frozen_imports(module: str = "torch") -> Iterator[None]:
    """Around the import of ``module``: no collection while it runs, and
    what is alive afterwards frozen.  Nothing is done where ``module`` is
    imported already or the collector is off."""
    if module in sys.modules or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def freeze_at_exit() -> None:
    """Freeze every object when the interpreter exits (registered once per
    process), so that its shutdown does not walk them.  The exit functions
    registered before it still run after it, as they would: freezing
    changes no reference count."""
    if not _exit_freeze["registered"]:
        _exit_freeze["registered"] = True
        atexit.register(gc.freeze)
