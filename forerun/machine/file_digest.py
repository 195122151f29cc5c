"""The digest of a file, as forerun's cache records it: the one place a file
is hashed, for every kind of cache entry (:mod:`forerun.loading.cache_entry`)
and for the compiled kernels (:mod:`forerun.kernels.build`).

A manifest records each file as :func:`describe_file` gives it: its size,
its SHA-256 and its *stamp* (modification time and inode), by which a file
that was rewritten or replaced is told from one left alone."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHUNK_BYTES = 8 << 20


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks of up to 8 MiB (a small
    file in one: zeroing an 8 MiB buffer costs more than hashing 100 KB)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(min(CHUNK_BYTES, max(os.fstat(f.fileno()).st_size, 1 << 16)))
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def file_stamp(st: os.stat_result) -> list[int]:
    """A file's stamp: its modification time (ns) and inode."""
    return [st.st_mtime_ns, st.st_ino]


def describe_file(path: Path) -> dict:
    """The manifest record of a file: ``size``, ``sha256`` and ``stamp``."""
    st = path.stat()
    return {"size": st.st_size, "sha256": sha256_of(path), "stamp": file_stamp(st)}
