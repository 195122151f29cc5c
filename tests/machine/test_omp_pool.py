"""A thread that hands the computing to another releases its OpenMP pool,
so that the computing thread's pool is the only one on the cores (two pools
made every parallel region of a server's decoding step wait for a sleeping
thread: 96 to 106 ms a token against 76 to 91 on a 2-core Zen 3).

Each check runs in a fresh interpreter, where the threads it counts are its
own."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import pytest

from thread_counts import run_counting


def run(body: str) -> dict:
    """``body`` after a parallel region of 2 threads (``with_pool``: the
    thread count then)."""
    return run_counting("parallel_work()\nwith_pool = tasks()\n" + textwrap.dedent(body))


@functools.cache
def torch_runs_on_libgomp() -> bool:
    return bool(run("print(json.dumps(loaded_libgomps()))"))


def needs_libgomp():
    if not torch_runs_on_libgomp():
        pytest.skip("this torch does not run on libgomp (not Linux, or another OpenMP runtime)")


def test_released_pool_ends_its_worker_threads():
    needs_libgomp()
    seen = run("""
        released = release_thread_pool()
        print(json.dumps({"with_pool": with_pool, "released": released,
                          "after": tasks(expect=with_pool - 1)}))
    """)
    assert seen["released"] is True
    assert seen["after"] == seen["with_pool"] - 1, seen     # the pool's one worker ended


def test_a_later_parallel_region_builds_the_pool_again():
    needs_libgomp()
    seen = run("""
        release_thread_pool()
        released = tasks(expect=with_pool - 1)
        parallel_work()
        print(json.dumps({"with_pool": with_pool, "released": released, "again": tasks()}))
    """)
    assert seen["released"] == seen["with_pool"] - 1, seen
    assert seen["again"] == seen["with_pool"], seen


def test_without_libgomp_nothing_is_released():
    code = ("import json\nfrom forerun.machine.omp_pool import loaded_libgomps, "
            "release_thread_pool\nprint(json.dumps([loaded_libgomps(), release_thread_pool()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[], False]      # torch not imported: no runtime


def test_the_engine_worker_releases_the_pool_of_the_thread_that_starts_it():
    """``forerun serve`` loads its model on the main thread and decodes on
    the worker's: starting the worker frees the main thread's pool."""
    needs_libgomp()
    seen = run("""
        from forerun.server.worker import EngineWorker
        # start() touches neither the model nor the prefix cache: no job comes.
        worker = EngineWorker(None, None, max_queue=1)
        worker.start()
        started = tasks(expect=with_pool)     # the worker thread in, the pool's worker out
        worker.join(10)
        print(json.dumps({"with_pool": with_pool, "started": started,
                          "alive": worker._thread.is_alive()}))
    """)
    assert seen["started"] == seen["with_pool"], seen
    assert seen["alive"] is False

