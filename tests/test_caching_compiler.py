"""The suite's caching C compiler (tests/caching_compiler.py): a kept build
must never stand in for a build of other sources or flags, or the kernel
tests that alter a source would test the unaltered library."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

import caching_compiler

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def compiler(tmp_path, monkeypatch):
    """The caching compiler over a real one that logs each command it runs
    (but ``--version``) to a file: (run, calls) where run(args) builds and
    calls() lists the real compiler's commands since the last call."""
    log = tmp_path / "calls"
    real = tmp_path / "real-cc"
    real.write_text(f'#!/bin/sh\n[ "$1" = --version ] || echo "$*" >> "{log}"\nexec cc "$@"\n')
    real.chmod(0o755)
    monkeypatch.setenv("FORERUN_TESTS_REAL_CC", str(real))
    monkeypatch.setenv("FORERUN_TESTS_COMPILED", str(tmp_path / "compiled"))
    seen = [0]

    def calls() -> list[str]:
        lines = log.read_text().splitlines() if log.is_file() else []
        new, seen[0] = lines[seen[0]:], len(lines)
        return new

    def run(args: list[str]) -> int:
        return caching_compiler.main(args)

    return run, calls


def _sources(folder: Path, a: int, b: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.c").write_text(f"int first(void) {{ return {a}; }}\n")
    (folder / "b.c").write_text("int first(void);\n"
                                f"int both(void) {{ return first() * 100 + {b}; }}\n")
    return [str(folder / "a.c"), str(folder / "b.c")]


def _both(library: Path) -> int:
    return ctypes.CDLL(str(library)).both()


def test_an_altered_source_compiles_alone_and_its_build_has_it(compiler, tmp_path):
    run, calls = compiler
    flags = ["-O2", "-shared", "-fPIC"]
    out = tmp_path / "one.so"
    assert run([*flags, *_sources(tmp_path / "v1", 1, 2), "-o", str(out)]) == 0
    assert _both(out) == 102
    assert [c.count(" -c ") for c in calls()] == [1, 1, 0]      # two sources, a link
    # b.c altered (in another folder, as a test's copy is): only it compiles.
    out2 = tmp_path / "two.so"
    assert run([*flags, *_sources(tmp_path / "v2", 1, 7), "-o", str(out2)]) == 0
    assert _both(out2) == 107
    made = calls()
    assert len(made) == 2 and "b.c" in made[0] and " -c " in made[0] and " -c " not in made[1]
    # The same command again: the kept library, no compiler at all.
    out3 = tmp_path / "three.so"
    assert run([*flags, *_sources(tmp_path / "v3", 1, 7), "-o", str(out3)]) == 0
    assert _both(out3) == 107 and calls() == []
    # Other flags build again (every source).
    out4 = tmp_path / "four.so"
    assert run(["-O1", "-shared", "-fPIC", *_sources(tmp_path / "v4", 1, 7), "-o", str(out4)]) == 0
    assert _both(out4) == 107 and len(calls()) == 3


def test_a_source_that_does_not_compile_is_never_kept(compiler, tmp_path):
    run, calls = compiler
    sources = _sources(tmp_path / "src", 3, 4)
    Path(sources[1]).write_text("int both(void) { return }\n")
    out = tmp_path / "lib.so"
    assert run(["-shared", "-fPIC", *sources, "-o", str(out)]) != 0
    assert not out.exists()
    calls()
    assert run(["-shared", "-fPIC", *sources, "-o", str(out)]) != 0
    again = calls()
    assert any("b.c" in c and " -c " in c for c in again)    # compiled again, not taken as kept
    kept = sorted(p.name for p in (tmp_path / "compiled").rglob("*") if p.is_file())
    assert len(kept) == 1 and kept[0].endswith(".o")           # a.c's object alone
