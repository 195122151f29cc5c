"""What forerun's cache holds, and what can be deleted from it.

The cache (:func:`~forerun.machine.paths.cache_dir`) holds:

* ``models/<preset>.gguf``: assembled presets (file entries, with a
  ``.manifest.json`` beside each);
* ``converted/<key>/``: GGUF files converted for the torch engine;
* ``gguf-header/<key>/``: parsed GGUF headers for the llama.cpp engine;
* ``packed/<key>/``: GGUF models built in the torch engine's quantized formats
  (q4, q8, q4-all);
* ``kernels/<name>.so``: forerun's native kernels as compiled here (file
  entries, with a ``.manifest.json`` beside each; checksummed even in a
  listing, since they are small);
* ``digests/``: remembered SHA-256 digests of model files (the keys above);
* ``calibration/``: what forerun measured on this machine (weight formats,
  kernels, verification costs; :mod:`forerun.machine.calibration`), one
  item, deleted only when asked (it is measured again when next needed);
* anything else (Medusa training caches), listed as ``other``.

:func:`scan` lists each as an :class:`Item` with its size, last use and
state; :func:`removable` says which a prune deletes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from forerun.loading.cache_entry import (
    MANIFEST_NAME,
    TMP_MARK,
    CacheEntry,
    check,
    read_manifest,
    remove_path,
    stale_temporaries,
)
from forerun.loading.presets import PRESETS, assembled_entry

#: kinds of entries, by the cache subfolder that holds them
ENTRY_FOLDERS = ("models", "converted", "gguf-header", "packed", "kernels")
#: the folders whose entries are files, each with its manifest beside it
FILE_ENTRY_FOLDERS = ("models", "kernels")


@dataclass
class Item:
    """One thing in the cache.

    ``kind``: ``preset``, ``converted``, ``gguf-header``, ``packed``, ``kernels``,
    ``temporary``, ``lock``, ``digests``, ``calibrations`` or ``other``.
    ``state``: ``ok``, or what is wrong (``stale``: left by a process that
    is gone; ``in use``: a temporary of a running process; ``damaged:
    ...``, ``incomplete ...``, ``written by another version ...``).
    ``last_used``: seconds since the epoch."""

    kind: str
    path: Path
    name: str
    size: int
    last_used: float
    state: str
    entry: CacheEntry | None = None

    @property
    def ok(self) -> bool:
        return self.state == "ok"


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (links not followed)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
        return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def entry_at(kind: str, path: Path) -> CacheEntry:
    """The :class:`CacheEntry` of a path in one of the :data:`ENTRY_FOLDERS`."""
    if kind == "models":
        preset = PRESETS.get(path.name.removesuffix(".gguf"))
        if preset is not None and path.suffix == ".gguf":
            return assembled_entry(preset)
        return CacheEntry(path, f"the GGUF file {path.name}", is_dir=False)
    if kind == "converted":
        from forerun.loading.conversion_cache import CONVERTER_VERSION

        return CacheEntry(path, f"the converted model {path.name}", version=CONVERTER_VERSION)
    if kind == "packed":
        from forerun.loading.packed_cache import PACKED_VERSION

        return CacheEntry(path, f"the packed weights {path.name}", version=PACKED_VERSION)
    if kind == "kernels":
        from forerun.kernels.build import LIBRARY_VERSION

        return CacheEntry(path, f"the native kernel library {path.name}",
                          version=LIBRARY_VERSION, is_dir=False)
    from forerun.loading.load import GGUF_HEADER_VERSION

    return CacheEntry(path, f"the parsed GGUF header {path.name}", version=GGUF_HEADER_VERSION)


def scan(root: Path, *, checksums: str = "none") -> list[Item]:
    """Everything under ``root``; entries are checked with ``checksums``
    (see :func:`~forerun.loading.cache_entry.check`)."""
    items: list[Item] = []
    if not root.is_dir():
        return items
    for top in sorted(root.iterdir()):
        if top.name in ENTRY_FOLDERS and top.is_dir():
            items.extend(_scan_entries(top, checksums))
        elif top.name == "digests" and top.is_dir():
            items.append(Item("digests", top, "model file digests", size_of(top),
                              _mtime(top), "ok"))
        elif top.name == "calibration" and top.is_dir():
            items.append(_calibrations(top))
        else:
            items.extend(_scan_loose(top))
    return items


def _scan_entries(folder: Path, checksums: str) -> Iterator[Item]:
    kind = folder.name
    if kind == "kernels":
        checksums = "all"       # a few small libraries, which can't be opened unchecked
    stale = {p.name for p in stale_temporaries(folder)}
    names = {p.name for p in folder.iterdir()}
    for p in sorted(folder.iterdir()):
        name = p.name
        if name.startswith(".") and name.endswith(".lock"):
            yield Item("lock", p, name, size_of(p), _mtime(p), "ok")
            continue
        if TMP_MARK in name or name in stale:
            yield Item("temporary", p, name, size_of(p), _mtime(p),
                       "stale" if name in stale else "in use")
            continue
        if kind in FILE_ENTRY_FOLDERS and name.endswith("." + MANIFEST_NAME):
            if name.removesuffix("." + MANIFEST_NAME) in names:
                continue   # counted with its file
            p = p.with_name(name.removesuffix("." + MANIFEST_NAME))   # its file is missing
            name = p.name
        entry = entry_at(kind, p)
        problem = check(entry, checksums=checksums)
        manifest = read_manifest(entry)
        label = (manifest or {}).get("meta", {}).get("name") or name
        size = size_of(p) + (0 if entry.is_dir else size_of(entry.manifest_path))
        used = _mtime(entry.manifest_path) if manifest else _mtime(p)
        yield Item("preset" if kind == "models" else kind, p, label, size, used,
                   problem or "ok", entry)


def _calibrations(folder: Path) -> Item:
    """The calibration records, as one item named by how many there are
    and how many were measured under load."""
    records = [p for p in folder.rglob("*.json") if p.is_file()]
    busy = 0
    for p in records:
        try:
            busy += bool(json.loads(p.read_text(encoding="utf-8"))["conditions"]["busy"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    name = f"{len(records)} measurements of this machine"
    if busy:
        name += f" ({busy} taken under load, measured again when it is idle)"
    return Item("calibrations", folder, name, size_of(folder), _mtime(folder), "ok")


def _scan_loose(top: Path) -> Iterator[Item]:
    """A top-level file or folder that is not an entry folder: a stale
    temporary of an old forerun, or something another part of forerun keeps
    (``other``)."""
    if top.name.startswith(".") and TMP_MARK in top.name:
        stale = top in stale_temporaries(top.parent)
        yield Item("temporary", top, top.name, size_of(top), _mtime(top),
                   "stale" if stale else "in use")
        return
    yield Item("other", top, top.name, size_of(top), _mtime(top), "ok")


def removable(item: Item, *, unused_days: float | None = None, everything: bool = False,
              calibrations: bool = False, now: float | None = None) -> bool:
    """Whether a prune deletes ``item``: stale temporaries, unheld lock
    files, stale digests and entries that are not whole, always; whole
    entries unused for ``unused_days``; the calibrations with
    ``calibrations``; with ``everything``, all but the temporaries of
    running processes."""
    if item.kind == "temporary":
        return item.state == "stale"
    if item.kind == "lock":
        return not _lock_held(item.path)
    if everything:
        return True
    if item.kind == "calibrations":
        return calibrations
    if item.kind == "digests" or item.kind == "other":
        return False
    if not item.ok:
        return True
    if unused_days is not None:
        return (now or time.time()) - item.last_used > unused_days * 86400
    return False


def _lock_held(path: Path) -> bool:
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    except OSError:
        return True
    lock.release()
    return False


def remove(item: Item) -> None:
    """Delete an item (an entry's manifest beside it too)."""
    remove_path(item.path)
    if item.entry is not None and not item.entry.is_dir:
        remove_path(item.entry.manifest_path)


def prune_digests(folder: Path) -> int:
    """Delete the remembered digests of files that are gone or changed;
    return how many."""
    removed = 0
    for p in folder.glob("*.json"):
        try:
            data = json.loads(p.read_text())
            st = os.stat(data["path"])
            fresh = st.st_size == data["size"] and st.st_mtime_ns == data["mtime_ns"]
        except (OSError, ValueError, KeyError, TypeError):
            fresh = False
        if not fresh:
            remove_path(p)
            removed += 1
    return removed
