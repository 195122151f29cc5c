"""Handing computation to another thread without slowing it: the thread
that gives it up releases its OpenMP thread pool.

libgomp (the OpenMP runtime of torch's Linux CPU wheels, which forerun's
native kernels share) keeps a pool of worker threads for each thread that
has run a parallel region.  While the threads of all pools outnumber the
CPUs, a worker that reaches a region's end spins only about 100 times (not
300,000) before it sleeps on a futex, so every one of a decoding step's
hundreds of parallel regions pays for waking it.  A server loads its model
on the main thread, which leaves a pool there, and decodes on an engine
thread, which makes a second one: on a 2-core AMD EPYC (Zen 3) a token took
96 to 106 ms on a new thread where it took 76 to 91 on the main thread, in
one run, and 192 tokens cost 72,868 context switches against 627.

:func:`release_thread_pool` ends the calling thread's pool (OpenMP 5's
``omp_pause_resource_all(omp_pause_soft)``, which libgomp carries out on the
host by freeing the calling thread's pool): ``forerun.load`` calls it when
it returns, every generation when it ends, and the server's worker when it
starts, so that the thread computing holds the only pool.  Nothing else
changes: a later parallel region on that thread builds a new pool.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("forerun.machine.omp_pool")

OMP_PAUSE_SOFT = 1


def loaded_libgomps() -> list[str]:
    """The paths of the libgomp copies this process has loaded (torch's;
    llama.cpp's where it brought its own), none where it runs another
    OpenMP runtime, has not loaded one yet, or is not on Linux."""
    if not sys.platform.startswith("linux"):
        return []
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                name = os.path.basename(path)
                if name.startswith("libgomp") and ".so" in name and path not in paths:
                    paths.append(path)
    except OSError:
        return []
    return paths


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP pool in every libgomp loaded (see the
    module); return whether one was released (False where no libgomp is
    loaded, where it lacks OpenMP 5's pause, or where it refuses, as it does
    inside a parallel region).  Never raises."""
    released = False
    for path in loaded_libgomps():
        try:
            gomp = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            pause = gomp.omp_pause_resource_all
        except (OSError, AttributeError):      # an old libgomp without the pause
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        if pause(OMP_PAUSE_SOFT) == 0:
            released = True
        else:
            log.debug("%s did not release this thread's pool", path)
    return released
