"""Fixtures of the native kernels' tests."""

from __future__ import annotations

import os

import pytest

from forerun.kernels import build, native


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    """An empty forerun cache, so the library is built again, and the
    loaded state forgotten before and after."""
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(native.SWITCH, "1")          # building, not timing, is tested here
    native.reset()
    yield tmp_path / "cache" / "kernels"
    native.reset()


@pytest.fixture()
def altered_source(fresh_cache, monkeypatch, tmp_path):
    """``alter(attribute, old, new)``: the library is built from a copy of
    the C source ``build.<attribute>`` with ``old`` replaced by ``new``."""
    def alter(attribute: str, old: str, new: str) -> None:
        source = getattr(build, attribute)
        text = source.read_text()
        assert old in text
        copy = tmp_path / source.name
        copy.write_text(text.replace(old, new))
        monkeypatch.setattr(build, attribute, copy)

    return alter


@pytest.fixture()
def real_compiler(monkeypatch):
    """The real C compiler as ``CC``, not the suite's caching one
    (tests/caching_compiler.py): for the tests of builds racing each other,
    whose overlap needs a build that takes its real time."""
    real = os.environ.get("FORERUN_TESTS_REAL_CC")
    if real:
        monkeypatch.setenv("CC", real)
