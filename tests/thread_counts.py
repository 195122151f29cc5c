"""Counting a fresh interpreter's threads around an OpenMP pool's life, for
the tests of :mod:`forerun.machine.omp_pool` and of its callers.  A pool of
2 threads is one worker beside the thread that made it; a released pool's
worker takes a moment to exit, so ``tasks(expect)`` polls for the count."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

HELPERS = textwrap.dedent("""
    import json, os, time
    import torch
    from forerun.machine.omp_pool import loaded_libgomps, release_thread_pool

    def tasks(expect=None):
        for _ in range(200):
            n = len(os.listdir("/proc/self/task"))
            if expect is None or n == expect:
                return n
            time.sleep(0.01)
        return n

    def parallel_work():
        torch.set_num_threads(2)
        torch.ones(1 << 22).mul_(2).sum()     # a parallel region of 2 threads
""")


def run_counting(body: str, timeout: float = 300) -> Any:
    """Run :data:`HELPERS` and then ``body`` in a fresh interpreter; the
    JSON value of the last line it prints."""
    out = subprocess.run([sys.executable, "-c", HELPERS + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
