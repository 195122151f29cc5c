"""Byte ranges of a file read into memory backed by transparent huge pages.

A decoding step streams every weight of the model once (about 1 GB for a
1.5B in q4).  Mapped from a file or allocated by torch, those weights sit in
4 KiB pages: a translation per 4 KiB, about 300,000 a step, each a miss in
the TLB.  In 2 MiB pages it is about 600.  On an AMD EPYC Zen 4 (2 threads,
Linux 6.18, transparent huge pages on ``madvise``) the 1.5B decoded 1.077
times as fast (the median of 10 rounds) from weights in huge pages as from
the same weights mapped from the cache file, alternated in one process; its
prefill did not change (``benchmarks/huge_pages_ab.py``).

:func:`read_ranges` reads ranges of a file into one anonymous mapping
aligned to 2 MiB and advised ``MADV_HUGEPAGE``, and returns them as uint8
tensors.  It returns None (the caller keeps what it has) where the system
has no transparent huge pages for it: not Linux, the kernel's setting
``never``, or ``FORERUN_HUGE_PAGES=0`` in the environment (memory that is
not shared: two processes serving the same model hold two copies, where a
mapping of the file shares the page cache).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

#: The size of a huge page the mapping is aligned to.
HUGE_PAGE = 2 << 20
#: Where each range starts in the mapping: a multiple of a cache line.
ALIGN = 64
#: Linux's madvise advice to fault every page in for writing (5.14 and later).
MADV_POPULATE_WRITE = 23
#: What one read asks for at most.
_READ = 64 << 20
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether :func:`read_ranges` can give huge pages here: Linux, its
    transparent huge pages ``always`` or ``madvise``, and
    ``FORERUN_HUGE_PAGES`` not ``0``."""
    if os.environ.get("FORERUN_HUGE_PAGES", "1").strip() == "0":
        return False
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def read_ranges(path: Path, ranges: Sequence[tuple[int, int]]) -> list[torch.Tensor] | None:
    """The bytes ``[offset, offset + size)`` of ``path`` for each of
    ``ranges``, as uint8 tensors in one mapping advised for huge pages (each
    starting at a multiple of :data:`ALIGN`), or None where huge pages are
    not :func:`available` or the mapping can't be had (no memory for it).
    Raises OSError when the file can't be read or ends before a range does."""
    if not ranges or not available():
        return None
    starts, total = [], 0
    for _, size in ranges:
        starts.append(total)
        total += -(-size // ALIGN) * ALIGN
    try:
        region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return None     # no memory to map, or no huge pages for it: the caller's stay
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    skip = -address % HUGE_PAGE
    _populate(address + skip, total)
    buffer = memoryview(region)[skip:skip + total]
    fd = os.open(path, os.O_RDONLY)
    try:
        for (offset, size), start in zip(ranges, starts):
            _read_exactly(fd, buffer[start:start + size], offset, path)
    finally:
        os.close(fd)
    whole = torch.frombuffer(buffer, dtype=torch.uint8) if total else torch.empty(0,
                                                                                 dtype=torch.uint8)
    return [whole[start:start + size] for (_, size), start in zip(ranges, starts)]


def _populate(address: int, size: int) -> None:
    """Fault the mapping's pages in at once (2.5 times faster than a page at
    a time as the reads reach them); where the kernel can't, they fault in
    as they are read."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(address, size - size % mmap.PAGESIZE, MADV_POPULATE_WRITE)


def _read_exactly(fd: int, into: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:done + _READ]], offset + done)
        if n <= 0:
            raise OSError(f"{path} ended at byte {offset + done}, before the "
                          f"{len(into)} bytes from {offset} were read")
        done += n
