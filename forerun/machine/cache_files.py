"""The files every entry of forerun's cache keeps beside its content, the
same for the entries of :mod:`forerun.loading.cache_entry` (models,
conversions, headers, packed weights) and for the compiled kernels of
:mod:`forerun.kernels.build`, so that ``forerun cache`` lists, verifies and
prunes them all alike:

* **A manifest**: JSON holding the builder's ``version``, a description
  (``what``), metadata, and each file's record
  (:func:`~forerun.machine.file_digest.describe_file`).  A folder entry keeps
  it inside as ``manifest.json``; a file entry beside it, as
  ``<name>.manifest.json`` (:func:`file_manifest_path`).
* **Temporaries** named ``.<name>.tmp-<host>-<pid>-<random>``
  (:func:`temporary_path`), so that one whose process is gone is told from
  one being written (:func:`stale_temporaries`) and swept.
* **Whole writes**: a temporary, then a rename (:func:`write_json_atomically`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"
TMP_MARK = ".tmp-"
# Temporaries of forerun versions before the manifest: "<name>.tmp<pid>".
_LEGACY_TMP = re.compile(r"\.tmp(\d+)$")
HOST = socket.gethostname().replace("-", "_") or "host"
#: Temporaries this process is writing right now (never swept).
OWN_TEMPORARIES: set[str] = set()


def file_manifest_path(path: Path) -> Path:
    """Where the manifest of the file entry ``path`` lives: beside it."""
    return path.with_name(path.name + "." + MANIFEST_NAME)


def temporary_prefix(path: Path) -> str:
    """The start of the name of a temporary of ``path`` written by this
    process (:func:`temporary_path` adds a random end)."""
    return f".{path.name}{TMP_MARK}{HOST}-{os.getpid()}-"


def temporary_path(path: Path) -> Path:
    """A fresh temporary path beside ``path``, named as
    :func:`stale_temporaries` recognises."""
    return path.with_name(temporary_prefix(path) + secrets.token_hex(4))


def new_manifest(version: str, what: str, files: Mapping[str, dict],
                 meta: Mapping | None = None) -> dict:
    """A manifest of ``files`` (name: :func:`~forerun.machine.file_digest.describe_file`
    record), written by the builder of ``version``."""
    return {"format": MANIFEST_FORMAT, "version": version, "what": what,
            "meta": dict(meta or {}), "files": dict(files)}


def notice_rebuild(what: str, path: Path, problem: str) -> None:
    """Tell the user (on stderr) that a damaged, incomplete or outdated
    cache entry is being rebuilt: every kind of entry says so the same way."""
    print(f"forerun: rebuilding {what} at {path}: {problem}", file=sys.stderr, flush=True)


def read_manifest_file(path: Path) -> dict | None:
    """The manifest in ``path``, or None when it is missing or not a manifest."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT
            and isinstance(data.get("files"), dict) and data["files"]):
        return None
    for info in data["files"].values():
        if not (isinstance(info, dict) and isinstance(info.get("size"), int)
                and isinstance(info.get("sha256"), str)):
            return None
    return data


def write_json_atomically(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary and a rename, so a
    reader sees the old file or the new one, never half of one."""
    tmp = temporary_path(path)
    try:
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def stale_temporaries(folder: Path) -> list[Path]:
    """Temporaries in ``folder`` whose writing process is gone: from this
    host with a dead pid, or this process's own pid but not one it is
    writing (a pid reused after a crash)."""
    stale = []
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    for p in children:
        name = p.name
        if TMP_MARK in name and name.startswith("."):
            host, _, rest = name.rsplit(TMP_MARK, 1)[1].partition("-")
            pid_text = rest.split("-", 1)[0]
            if host != HOST or not pid_text.isdigit():
                continue
            pid = int(pid_text)
            if str(p) in OWN_TEMPORARIES:
                continue
            if pid == os.getpid() or not pid_alive(pid):
                stale.append(p)
        else:
            m = _LEGACY_TMP.search(name)
            if m and not pid_alive(int(m.group(1))):
                stale.append(p)
    return stale


def remove_path(p: Path) -> None:
    """Delete a file or folder; a missing one is fine."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def sweep_temporaries(folder: Path) -> list[Path]:
    """Delete the stale temporaries in ``folder``; return them."""
    stale = stale_temporaries(folder)
    for p in stale:
        remove_path(p)
    return stale
