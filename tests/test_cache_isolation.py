"""The suite runs on forerun caches of its own, never the user's (see
``conftest.py``): build products in the tests' shared cache, calibration
private to the session.  ``conftest.py`` also fails any test that leaves
``FORERUN_CACHE`` unset or pointing at the user's cache, and the session
when the user's cache changed while it ran."""

from __future__ import annotations

import os
from pathlib import Path

from forerun.machine.paths import cache_dir

SHARED = ("models", "packed", "converted", "digests", "gguf-header", "kernels")


def inside(path: Path, root: Path) -> bool:
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def test_forerun_uses_the_sessions_cache_not_the_users(suite_caches):
    users, shared, session = suite_caches
    assert cache_dir().resolve() == session.resolve()
    for user in users:
        assert not inside(cache_dir(), user)
        assert not inside(shared, user) and not inside(user, shared)
    for name in SHARED:
        # Build products are shared between runs, in the tests' cache.
        assert (cache_dir() / name).is_symlink(), name
        assert inside(cache_dir() / name, shared), name
    # Calibration (timings, stored choices) is this session's own.
    calibration = cache_dir() / "calibration"
    assert not calibration.is_symlink()
    assert not calibration.exists() or inside(calibration, session)


def test_presets_are_assembled_into_the_tests_cache(suite_caches):
    from forerun.loading.presets import assembled_path, get_preset

    users, shared, _ = suite_caches
    path = assembled_path(get_preset("smollm2-135m"))
    assert inside(path, shared) and not any(inside(path, user) for user in users)


def test_the_default_cache_is_among_the_guarded(suite_caches):
    users, _, _ = suite_caches
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    assert (Path(base) / "forerun").resolve() in users


def test_subprocesses_inherit_the_sessions_cache(suite_caches):
    """``forerun`` processes the tests start (serve, generate) use the same
    cache as the tests."""
    import subprocess
    import sys

    _, _, session = suite_caches
    out = subprocess.run(
        [sys.executable, "-c", "from forerun.machine.paths import cache_dir; print(cache_dir())"],
        capture_output=True, text=True, env=dict(os.environ), check=True)
    assert Path(out.stdout.strip()).resolve() == session.resolve()
