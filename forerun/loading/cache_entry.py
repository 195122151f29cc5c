"""One entry of forerun's cache: built once, under a lock, into a temporary
that is published atomically, and checked at every load.

An entry is a file or a folder under :func:`~forerun.machine.paths.cache_dir` (a
converted model, an assembled preset GGUF, a parsed GGUF header, ...).  Every
kind of entry goes through :func:`ensure`:

* **Check.**  A manifest written with the entry records each file's size and
  SHA-256 (and the builder's ``version``).  At load, every size is compared,
  every small file is checksummed, and a large file is checksummed only when
  its *stamp* (modification time and inode) differs from the one recorded,
  so a file that was rewritten, truncated or replaced is always read again,
  while an untouched multi-GB file costs one ``stat``.  (A change that keeps
  a file's size and modification time is only found by a full check:
  ``forerun cache verify``.)
* **Build.**  A missing, damaged or outdated entry is rebuilt under a file
  lock (``.<name>.lock`` beside it): a second process building the same entry
  waits, then uses the first one's result.  The build writes into a temporary
  (``.<name>.tmp-<host>-<pid>-<random>``) that is removed if the build fails
  or is interrupted, and renamed into place only once complete.  Temporaries
  left by killed processes (their pid is gone) are swept before each build.
* **Fail clearly.**  An entry that can't be rebuilt (a read-only cache, a
  failing build) raises :class:`~forerun.errors.CacheError` naming the path to
  delete or the directory to fix.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from forerun.errors import CacheError, ForerunError

# The manifest, the temporaries and the digest are those of every cache
# entry, the compiled kernels' too (forerun.machine.cache_files).
from forerun.machine.cache_files import MANIFEST_NAME as MANIFEST_NAME
from forerun.machine.cache_files import OWN_TEMPORARIES as _OWN_TEMPORARIES
from forerun.machine.cache_files import TMP_MARK as TMP_MARK
from forerun.machine.cache_files import (
    file_manifest_path,
    new_manifest,
    notice_rebuild,
    read_manifest_file,
    remove_path,
    sweep_temporaries,
    temporary_path,
    write_json_atomically,
)
from forerun.machine.cache_files import stale_temporaries as stale_temporaries
from forerun.machine.file_digest import describe_file, sha256_of
from forerun.machine.file_digest import file_stamp as _stamp

#: files up to this size are checksummed at every load
SMALL_FILE_BYTES = 64 << 20


@dataclass(frozen=True)
class CacheEntry:
    """Where an entry lives and what it must hold.

    ``path``: the entry's file or folder.  ``what``: its description in
    messages ("the converted weights of model.gguf").  ``version``: the
    builder's format version; an entry written by another version is
    rebuilt.  ``expected``: SHA-256 digests that named files must have
    whatever the manifest says (a preset's published checksum); an entry
    without a manifest whose files all match is adopted as is.
    ``is_dir``: a folder entry (else one file)."""

    path: Path
    what: str
    version: str = "1"
    expected: Mapping[str, str] = field(default_factory=dict)
    is_dir: bool = True

    @property
    def manifest_path(self) -> Path:
        if self.is_dir:
            return self.path / MANIFEST_NAME
        return file_manifest_path(self.path)

    @property
    def root(self) -> Path:
        """The folder the manifest's file names are relative to."""
        return self.path if self.is_dir else self.path.parent

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.lock")


# -- checksums and manifests ------------------------------------------------

def describe_files(root: Path, names: list[str] | None = None) -> dict[str, dict]:
    """Size, SHA-256 and stamp of each file under ``root`` (every file, in
    subfolders too, when ``names`` is None), the manifest is left out."""
    if names is None:
        names = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                       if p.is_file() and p.name != MANIFEST_NAME)
    return {name: describe_file(root / name) for name in names}


def read_manifest(entry: CacheEntry) -> dict | None:
    """The entry's manifest, or None when it is missing or not a manifest."""
    return read_manifest_file(entry.manifest_path)


def check(entry: CacheEntry, *, checksums: str = "changed") -> str | None:
    """What is wrong with the entry (missing, incomplete, damaged, another
    version), or None when it is whole.

    ``checksums``: ``"changed"`` (at load) checksums small files and the
    large ones whose stamp changed; ``"all"`` checksums every file;
    ``"none"`` compares sizes only (a listing).  A large file found whole
    under a new stamp gets the new stamp recorded (when the cache is
    writable), so it is read once."""
    if not entry.path.exists():
        return "missing"
    manifest = read_manifest(entry)
    if manifest is None:
        if entry.expected and checksums != "none":
            return _adopt(entry)
        return "incomplete (no valid manifest)"
    if manifest.get("version") != entry.version:
        return f"written by another version ({manifest.get('version')!r}, now {entry.version!r})"
    restamped = False
    for name, info in manifest["files"].items():
        want = entry.expected.get(name)
        if want is not None and info["sha256"] != want:
            return f"{name} is not the expected content"
        p = entry.root / name
        try:
            st = p.stat()
        except OSError:
            return f"{name} is missing"
        if st.st_size != info["size"]:
            return f"{name} has {st.st_size} bytes, expected {info['size']}"
        if checksums == "none":
            continue
        if (checksums == "all" or st.st_size <= SMALL_FILE_BYTES
                or info.get("stamp") != _stamp(st)):
            if sha256_of(p) != info["sha256"]:
                return f"{name} is damaged (its SHA-256 differs from the one recorded)"
            if info.get("stamp") != _stamp(st):
                info["stamp"] = _stamp(st)
                restamped = True
    if restamped:
        try:
            write_json_atomically(entry.manifest_path, manifest)
        except OSError:
            pass   # a read-only cache checksums the file again next time
    return None


def _adopt(entry: CacheEntry) -> str | None:
    """An entry without a manifest whose files all have the ``expected``
    digests gets a manifest (an entry assembled by an older forerun)."""
    for name, want in entry.expected.items():
        p = entry.root / name
        if not p.is_file():
            return f"{name} is missing"
        if sha256_of(p) != want:
            return f"{name} is not the expected content"
    try:
        write_json_atomically(entry.manifest_path, _manifest(
            entry, describe_files(entry.root, list(entry.expected)), {}))
    except OSError:
        pass
    return None


def _manifest(entry: CacheEntry, files: dict[str, dict], meta: Mapping) -> dict:
    return new_manifest(entry.version, entry.what, files, meta)


# -- temporaries --------------------------------------------------------------

@contextmanager
def temporary(entry: CacheEntry) -> Iterator[Path]:
    """A fresh temporary path beside the entry (a folder for a folder
    entry), removed on the way out unless it was published."""
    tmp = temporary_path(entry.path)
    _OWN_TEMPORARIES.add(str(tmp))
    try:
        if entry.is_dir:
            tmp.mkdir()
        yield tmp
    finally:
        try:
            remove_path(tmp)
        finally:
            _OWN_TEMPORARIES.discard(str(tmp))


def publish(entry: CacheEntry, tmp: Path, meta: Mapping | None = None) -> None:
    """Write the manifest of the complete temporary ``tmp`` and move it into
    place, replacing a damaged entry."""
    if entry.is_dir:
        write_json_atomically(tmp / MANIFEST_NAME,
                              _manifest(entry, describe_files(tmp), meta or {}))
        if entry.path.exists():
            with temporary(CacheEntry(entry.path, entry.what, is_dir=False)) as trash:
                os.replace(entry.path, trash)
                os.replace(tmp, entry.path)
        else:
            os.replace(tmp, entry.path)
    else:
        # A rename keeps the size, modification time and inode: the stamp.
        files = {entry.path.name: describe_files(tmp.parent, [tmp.name])[tmp.name]}
        os.replace(tmp, entry.path)
        write_json_atomically(entry.manifest_path, _manifest(entry, files, meta or {}))


# -- the lock -----------------------------------------------------------------

@contextmanager
def build_lock(entry: CacheEntry, *, progress: bool = False) -> Iterator[None]:
    """Hold the entry's file lock; tell the user when another process holds
    it and this one waits."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(entry.lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if progress:
            print(f"forerun: waiting for another process that is building {entry.what}",
                  file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


# -- all together -------------------------------------------------------------

Build = Callable[[Path], "Mapping | None"]


def ensure(entry: CacheEntry, build: Build, *, progress: bool = False) -> Path:
    """The entry's path, whole: checked, or (re)built when it is missing,
    damaged or outdated.  ``build(tmp)`` writes the entry into ``tmp`` (a
    new empty folder, or a file path to create) and may return metadata for
    the manifest.  Raises :class:`CacheError` when the entry can't be built
    and published (the message names what to delete or fix); errors of the
    build itself (a corrupt source file) propagate unchanged, and in every
    case the temporary is removed."""
    problem = check(entry)
    if problem is None:
        _touch(entry)
        return entry.path
    try:
        entry.path.parent.mkdir(parents=True, exist_ok=True)
        sweep_temporaries(entry.path.parent)
        with build_lock(entry, progress=progress):
            problem = check(entry)       # another process may have built it meanwhile
            if problem is None:
                return entry.path
            if problem != "missing":     # damage is never silent, progress or not
                notice_rebuild(entry.what, entry.path, problem)
            with temporary(entry) as tmp:
                meta = build(tmp)
                publish(entry, tmp, meta if isinstance(meta, Mapping) else None)
    except OSError as exc:
        if isinstance(exc, ForerunError):   # the build's own errors (a bad source file)
            raise
        damaged = entry.path.exists() and problem != "missing"
        fix = (f"delete {entry.path} (and {entry.manifest_path})" if damaged and not entry.is_dir
               else f"delete {entry.path}" if damaged
               else f"make {entry.path.parent} writable")
        raise CacheError(
            f"{entry.what} is {f'damaged: {problem}' if damaged else 'not in the cache'} and "
            f"can't be written to {entry.path.parent} ({exc.strerror or exc}); {fix}, or set "
            f"FORERUN_CACHE to a writable directory") from exc
    return entry.path


def _touch(entry: CacheEntry) -> None:
    """Record the entry's last use (the manifest's modification time), for
    ``forerun cache prune --unused-days``."""
    try:
        os.utime(entry.manifest_path)
    except OSError:
        pass
