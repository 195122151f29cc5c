"""The compiled kernel library as an entry of forerun's cache (issue 42, rows
1 and 4): checked against its manifest before it is opened, rebuilt with a
notice when damaged (a foreign library in its place, one truncated to half,
one with 192 bytes flipped and its mtime kept), refused with a clear error
where the cache is read-only, and no temporary left behind on any path.

Every load of a damaged library runs in a child process, so that a
regression that opens one kills the child (SIGBUS, SIGSEGV), not pytest;
pytest itself never maps a library these tests damage."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from forerun.kernels import build, native
from forerun.machine.cache_files import (
    HOST,
    TMP_MARK,
    file_manifest_path,
    new_manifest,
    write_json_atomically,
)
from forerun.machine.file_digest import describe_file

DAMAGES = ["foreign", "truncated", "flipped"]

# A child that loads the kernels and says what it got.  With
# TEST_READ_ONLY_CACHE set and run as root (who writes into read-only
# folders), the cache's writes fail as on a read-only mount: creating a file
# in it raises EACCES.  (Other users get a chmod'ed folder, see read_only.)
CHILD = """
import os, sys, tempfile
from forerun.errors import ForerunError
from forerun.kernels import native
if os.environ.get("TEST_READ_ONLY_CACHE") and os.geteuid() == 0:
    cache, real = os.environ["FORERUN_CACHE"], tempfile.mkstemp
    def mkstemp(*args, **kwargs):
        if str(kwargs.get("dir", "")).startswith(cache):
            raise PermissionError(13, "Permission denied", str(kwargs["dir"]))
        return real(*args, **kwargs)
    tempfile.mkstemp = mkstemp
try:
    kernels = native.native_kernels()
    print("loaded" if kernels is not None else f"unavailable: {native.unavailable_reason()}")
except ForerunError as exc:
    print(f"refused: {type(exc).__name__}: {exc}")
"""


def _foreign_library() -> Path:
    """A valid shared library that is not forerun's."""
    import _ctypes

    libm = Path("/lib/x86_64-linux-gnu/libm.so.6")
    return libm if libm.is_file() else Path(_ctypes.__file__)


def _died(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def load_in_child(cache: Path, tmpdir: Path, *, read_only: bool = False) -> tuple[str, str]:
    """``native_kernels()`` in a fresh Python with ``FORERUN_CACHE=cache``
    and ``TMPDIR=tmpdir``: (what it printed, its stderr).  The child must
    exit 0: a crash is a failure, whatever the test expects."""
    env = {**os.environ, "FORERUN_CACHE": str(cache), native.SWITCH: "1",
           "TMPDIR": str(tmpdir)}
    env.pop("TEST_READ_ONLY_CACHE", None)
    if read_only:
        env["TEST_READ_ONLY_CACHE"] = "1"
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (f"the child loading the kernels died ({_died(done.returncode)})"
                                  f":\n{done.stderr[-3000:]}")
    return done.stdout.strip(), done.stderr


@contextlib.contextmanager
def read_only(folders: list[Path]):
    """The cache's folders read-only for the child (as a non-root user; root
    writes anyway, and the child refuses its own writes, see CHILD)."""
    if os.geteuid() == 0:
        yield
        return
    for folder in folders:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        yield
    finally:
        for folder in folders:
            folder.chmod(stat.S_IRWXU)


def damage(library: Path, how: str) -> None:
    """Damage ``library`` in place (the same inode), keeping its mtime."""
    st = library.stat()
    if how == "foreign":
        shutil.copyfile(_foreign_library(), library)
    elif how == "truncated":
        os.truncate(library, st.st_size // 2)
    else:
        with open(library, "r+b") as f:
            f.seek(st.st_size // 2)
            chunk = f.read(192)
            f.seek(st.st_size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
    os.utime(library, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A kernels folder as a first load leaves it (built once, in a child),
    to copy into each test's cache: the copies are new files no process has
    mapped."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    tmpdir = tmp_path_factory.mktemp("tmpdir")
    out, err = load_in_child(cache, tmpdir)
    if out != "loaded":
        pytest.skip(f"forerun's native kernels don't run here: {out} {err[-500:]}")
    return cache / "kernels"


@pytest.fixture()
def tmpdir_of_child(tmp_path) -> Path:
    """An empty $TMPDIR for the child, to find what it leaves there."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    return folder


def libraries(kernels: Path) -> list[Path]:
    return sorted(kernels.glob("*.so"))


def leftovers(kernels: Path) -> list[str]:
    """What in the kernels folder is neither a library, its manifest nor its lock."""
    return sorted(p.name for p in kernels.iterdir()
                  if not (p.name.endswith((".so", ".so.manifest.json", ".so.lock"))
                          and TMP_MARK not in p.name))


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_library_is_rebuilt_with_a_notice(fresh_cache, built, tmpdir_of_child, how):
    shutil.copytree(built, fresh_cache)
    targets = libraries(fresh_cache)
    for library in targets:
        damage(library, how)
    # A temporary that a killed build left is swept by the rebuild.
    killed = fresh_cache / f".{targets[0].name}{TMP_MARK}{HOST}-{_dead_pid()}-abcd1234"
    killed.write_bytes(b"half a library")

    out, err = load_in_child(fresh_cache.parent, tmpdir_of_child)
    assert out == "loaded"
    for library in targets:
        assert f"forerun: rebuilding forerun's native kernel library at {library}: " in err
        assert build.library_problem(library) is None
    reason = "is damaged (its SHA-256 differs" if how == "flipped" else "bytes, expected"
    assert reason in err
    assert not killed.exists() and leftovers(fresh_cache) == []
    assert list(tmpdir_of_child.iterdir()) == []
    out, err = load_in_child(fresh_cache.parent, tmpdir_of_child)     # whole now: no notice
    assert out == "loaded" and "rebuilding" not in err


def test_a_library_without_the_abi_symbol_is_damaged(fresh_cache, built, tmpdir_of_child):
    """A foreign library whose manifest was rewritten to match it opens, but
    has no fr_abi_version: damaged, and rebuilt."""
    shutil.copytree(built, fresh_cache)
    for library in libraries(fresh_cache):
        damage(library, "foreign")
        write_json_atomically(file_manifest_path(library), new_manifest(
            build.LIBRARY_VERSION, "forged", {library.name: describe_file(library)}))

    out, err = load_in_child(fresh_cache.parent, tmpdir_of_child)
    assert out == "loaded"
    assert "it has no fr_abi_version: not forerun's kernel library" in err
    assert all(build.library_problem(lib) is None and lib.stat().st_size < 500_000
               for lib in libraries(fresh_cache))


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_library_in_a_read_only_cache_is_refused(fresh_cache, built, tmpdir_of_child,
                                                          how):
    """Where it can't be rebuilt, a damaged library is refused with a
    CacheError naming it, never opened, and nothing is written anywhere."""
    shutil.copytree(built, fresh_cache)
    targets = libraries(fresh_cache)
    for library in targets:
        damage(library, how)
    before = {p.name: p.read_bytes() for p in fresh_cache.iterdir()}

    with read_only([fresh_cache.parent, fresh_cache]):
        out, _ = load_in_child(fresh_cache.parent, tmpdir_of_child, read_only=True)
    assert out.startswith("refused: CacheError: forerun's native kernel library ")
    # whichever library loads first (their names are hashes of their sources)
    assert any(str(t) in out for t in targets)
    assert "is damaged" in out and "can't be rebuilt" in out
    assert "delete" in out and "FORERUN_CACHE" in out
    assert {p.name: p.read_bytes() for p in fresh_cache.iterdir()} == before
    assert list(tmpdir_of_child.iterdir()) == []


@pytest.mark.parametrize("cached", ["nothing", "a foreign file without a manifest"])
def test_a_read_only_cache_leaves_no_temporary(fresh_cache, built, tmpdir_of_child, cached):
    """A read-only cache that lacks the library (or holds a file it can't
    verify) builds it into a temporary folder for the run, and removes the
    folder: nothing is left in $TMPDIR (issue 42, row 4), nor in the cache."""
    fresh_cache.mkdir(parents=True)
    if cached != "nothing":
        for library in libraries(built):
            shutil.copyfile(_foreign_library(), fresh_cache / library.name)
    before = sorted(p.name for p in fresh_cache.iterdir())

    with read_only([fresh_cache.parent, fresh_cache]):
        out, _ = load_in_child(fresh_cache.parent, tmpdir_of_child, read_only=True)
    assert out == "loaded"
    assert list(tmpdir_of_child.iterdir()) == []
    assert sorted(p.name for p in fresh_cache.iterdir()) == before


def test_a_failed_build_leaves_nothing(fresh_cache, monkeypatch, tmp_path):
    """A build that fails removes its temporary, in the cache and (read-only
    cache) in $TMPDIR, along with the compiler's own temporaries."""
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(build, "SOURCE", broken)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert native.native_kernels() is None
    assert "failed to build broken.c" in native.unavailable_reason()
    assert leftovers(fresh_cache) == [] and not libraries(fresh_cache)

    native.reset()
    monkeypatch.setattr(tempfile, "mkstemp", _refusing_mkstemp(fresh_cache))
    assert native.native_kernels() is None
    assert "failed to build broken.c" in native.unavailable_reason()
    assert list(scratch.iterdir()) == []


def _refusing_mkstemp(folder: Path):
    """tempfile.mkstemp, refusing to create files in ``folder`` as a
    read-only folder does (for root, who writes into any folder)."""
    real = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        if str(folder) in str(kwargs.get("dir")):
            raise PermissionError(13, "Permission denied", str(kwargs["dir"]))
        return real(*args, **kwargs)
    return mkstemp


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
