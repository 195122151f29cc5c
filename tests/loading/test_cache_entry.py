"""forerun.loading.cache_entry: the life of one cache entry, for any kind of
entry (a folder or a file): check, build under a lock into a temporary,
publish atomically, sweep what killed processes left."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from forerun.errors import CacheError, ModelFormatError
from forerun.loading import cache_entry
from forerun.loading.cache_entry import (
    TMP_MARK,
    CacheEntry,
    check,
    ensure,
    stale_temporaries,
    sweep_temporaries,
)
from forerun.machine import cache_files


def temporaries(root):
    return [p for p in root.rglob("*") if TMP_MARK in p.name or ".tmp" in p.name]


def write_two_files(out):
    (out / "a.bin").write_bytes(b"a" * 1000)
    (out / "sub").mkdir()
    (out / "sub" / "b.json").write_text('{"b": 1}')
    return {"source": "test"}


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_folder_entry_is_built_once_then_checked(tmp_path):
    entry = CacheEntry(tmp_path / "e", "test entry")
    calls = []
    build = lambda out: calls.append(out) or write_two_files(out)   # noqa: E731
    assert ensure(entry, build) == entry.path
    assert ensure(entry, build) == entry.path
    assert len(calls) == 1
    assert check(entry) is None and check(entry, checksums="all") is None
    assert not temporaries(tmp_path)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest", "version"])
def test_damaged_folder_entry_is_rebuilt(tmp_path, damage):
    entry = CacheEntry(tmp_path / "e", "test entry")
    ensure(entry, write_two_files)
    target = entry.path / "a.bin"
    if damage == "flip":
        target.write_bytes(b"a" * 500 + b"b" + b"a" * 499)     # same size
    elif damage == "truncate":
        target.write_bytes(b"a" * 10)
    elif damage == "delete":
        (entry.path / "sub" / "b.json").unlink()
    elif damage == "manifest":
        entry.manifest_path.write_text("{not json")
    else:
        entry = CacheEntry(entry.path, "test entry", version="2")
    assert check(entry) is not None
    ensure(entry, write_two_files)
    assert check(entry) is None
    assert target.read_bytes() == b"a" * 1000
    assert not temporaries(tmp_path)


def test_large_files_are_checksummed_when_their_stamp_changes(tmp_path, monkeypatch):
    """A large file is trusted while its size, modification time and inode
    are those recorded; a change of any of them reads it again.  A change
    that keeps all three is found by a full check (forerun cache verify)."""
    monkeypatch.setattr(cache_entry, "SMALL_FILE_BYTES", 0)
    entry = CacheEntry(tmp_path / "e", "test entry")
    ensure(entry, write_two_files)
    target = entry.path / "a.bin"
    st = target.stat()
    with open(target, "r+b") as f:       # same size, same inode
        f.seek(10)
        f.write(b"X")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert check(entry) is None                              # the documented limit
    assert "damaged" in check(entry, checksums="all")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert "damaged" in check(entry)


def test_file_entry_with_expected_digest(tmp_path):
    import hashlib

    data = b"model bytes" * 100
    want = hashlib.sha256(data).hexdigest()
    path = tmp_path / "models" / "m.gguf"
    entry = CacheEntry(path, "a model file", expected={"m.gguf": want}, is_dir=False)
    ensure(entry, lambda out: out.write_bytes(data))
    assert path.read_bytes() == data and check(entry) is None
    # Same size, other bytes: never used.
    path.write_bytes(b"X" + data[1:])
    assert check(entry) is not None
    ensure(entry, lambda out: out.write_bytes(data))
    assert path.read_bytes() == data
    # A file without a manifest (an older forerun's) is adopted when its
    # content is the expected one, and rebuilt otherwise.
    entry.manifest_path.unlink()
    assert check(entry) is None and entry.manifest_path.is_file()
    assert not temporaries(tmp_path)


def test_a_build_that_fails_leaves_nothing(tmp_path):
    entry = CacheEntry(tmp_path / "e", "test entry")

    def failing(out):
        write_two_files(out)
        raise ModelFormatError("the source is corrupt")

    def interrupted(out):
        write_two_files(out)
        raise KeyboardInterrupt

    with pytest.raises(ModelFormatError, match="source is corrupt"):
        ensure(entry, failing)
    with pytest.raises(KeyboardInterrupt):
        ensure(entry, interrupted)
    assert not entry.path.exists()
    assert not temporaries(tmp_path)


def test_stale_temporaries_of_dead_processes_are_swept(tmp_path):
    folder = tmp_path / "converted"
    folder.mkdir()
    host = cache_files.HOST
    dead, alive = dead_pid(), os.getppid()
    stale = [folder / f".x{TMP_MARK}{host}-{dead}-abcd", folder / f"old-abc.tmp{dead}"]
    live = [folder / f".y{TMP_MARK}{host}-{alive}-abcd",
            folder / f".z{TMP_MARK}otherhost-{dead}-ab"]
    for p in stale + live:
        p.mkdir()
        (p / "big.bin").write_bytes(b"0" * 100)
    assert sorted(stale_temporaries(folder)) == sorted(stale)
    sweep_temporaries(folder)
    assert all(not p.exists() for p in stale) and all(p.exists() for p in live)


def test_a_second_builder_waits_and_uses_the_first_ones_result(tmp_path):
    entry = CacheEntry(tmp_path / "e", "test entry")
    started, release = threading.Event(), threading.Event()
    builds = []

    def slow(out):
        builds.append(out)
        started.set()
        release.wait(timeout=30)
        return write_two_files(out)

    first = threading.Thread(target=ensure, args=(entry, slow))
    first.start()
    started.wait(timeout=30)
    second_result = []
    second = threading.Thread(target=lambda: second_result.append(ensure(entry, slow)))
    second.start()
    release.set()
    first.join(timeout=30)
    second.join(timeout=30)
    assert second_result == [entry.path] and len(builds) == 1
    assert check(entry) is None


def test_an_entry_that_cannot_be_written_names_what_to_fix(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    entry = CacheEntry(blocker / "converted" / "e", "the converted weights of m.gguf")
    with pytest.raises(CacheError, match="FORERUN_CACHE") as info:
        ensure(entry, write_two_files)
    assert "the converted weights of m.gguf" in str(info.value)


def test_an_unusable_cache_directory_is_a_clear_error(tmp_path, monkeypatch):
    from forerun.machine.paths import cache_dir

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("FORERUN_CACHE", str(blocker))
    with pytest.raises(CacheError, match="is not a directory"):
        cache_dir()
    monkeypatch.setenv("FORERUN_CACHE", str(blocker / "sub"))
    with pytest.raises(CacheError, match="can't be created"):
        cache_dir()


def test_a_cache_directory_made_by_another_process_meanwhile_is_used(tmp_path, monkeypatch):
    """Two processes on a fresh cache: the folder is absent when one looks,
    and the other creates it before this one goes on (the race a CI run of
    two concurrent conversions hit, which reported the new folder as a
    file)."""
    from pathlib import Path

    from forerun.machine.paths import cache_dir

    root = tmp_path / "cache"
    monkeypatch.setenv("FORERUN_CACHE", str(root))
    real_is_dir = Path.is_dir
    raced = []

    def is_dir_then_made(self):
        if self == root and not raced:          # absent at the first look...
            raced.append(True)
            root.mkdir()                        # ...then the other process makes it
            return False
        return real_is_dir(self)

    monkeypatch.setattr(Path, "is_dir", is_dir_then_made)
    assert cache_dir() == root and raced


def test_a_rebuilt_entry_says_so_even_without_progress(tmp_path, capsys):
    """Issue 42: a damaged entry built with ``progress=False`` (the GGUF
    header cache, a quiet load) was rebuilt silently."""
    entry = CacheEntry(tmp_path / "e", "test entry")
    ensure(entry, write_two_files)
    assert capsys.readouterr().err == ""
    (entry.path / "a.bin").write_bytes(b"b" * 1000)
    ensure(entry, write_two_files, progress=False)
    err = capsys.readouterr().err
    assert f"forerun: rebuilding test entry at {entry.path}: a.bin is damaged" in err
