"""Keys of cache entries by content: the SHA-256 of a model file.

Cache entries derived from a file (its converted weights, its parsed header)
are keyed by what the file holds, not by where it lies, so a model that is
moved, copied or assembled again maps to the same entry.  Hashing a GGUF of
a few GB takes seconds, so each digest is remembered in
``<cache>/digests/`` under the file's path, size, modification time and
inode: the file is hashed again only when one of them changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from forerun.loading.cache_entry import (
    notice_rebuild,
    sha256_of,
    sweep_temporaries,
    write_json_atomically,
)
from forerun.machine.paths import cache_dir

_HEX64 = re.compile(r"[0-9a-f]{64}")


def _memo_path(path: Path, st: os.stat_result) -> Path:
    key = hashlib.sha256(
        f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}".encode()).hexdigest()[:24]
    return cache_dir() / "digests" / f"{key}.json"


def file_digest(path: Path) -> str:
    """The SHA-256 (hex) of ``path``'s bytes, from the memo when the file is
    unchanged since it was last hashed."""
    path = path.resolve()
    st = path.stat()
    memo = _memo_path(path, st)
    damaged = False
    try:
        data = json.loads(memo.read_text())
        if (data.get("path") == str(path) and data.get("size") == st.st_size
                and _HEX64.fullmatch(str(data.get("sha256")))):
            return data["sha256"]
        damaged = True
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError):
        damaged = True
    if damaged:
        notice_rebuild(f"the SHA-256 digest of {path.name}", memo,
                       "damaged (not a digest record of this file)")
    digest = sha256_of(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        sweep_temporaries(memo.parent)
        write_json_atomically(memo, {"path": str(path), "size": st.st_size,
                                     "mtime_ns": st.st_mtime_ns, "sha256": digest})
    except OSError:
        pass   # a read-only cache hashes the file again next time
    return digest
