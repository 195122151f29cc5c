"""Where a command writes its results: checked before any work starts, and
written whole or not at all.

A command that runs for minutes (a benchmark, a training run) checks its
output path first (:func:`check_output_file`, :func:`check_output_dir`), so
a path it can't write fails at once instead of losing the work at the end;
:func:`written_whole` writes through a temporary file in the same folder
and a rename, so a reader never sees half a file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from forerun.errors import ForerunError


class OutputPathError(ForerunError):
    """An output path the command could not write."""


def check_output_file(path: str | Path, option: str) -> Path:
    """``path`` as a file the command may write (``option`` names it in the
    error): not a folder, in a folder that exists or can be made and that
    this process may write."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise OutputPathError(f"{option} {out} is a folder; give a file name, e.g. "
                              f"{out / 'heads.safetensors'}")
    _writable_folder(out.parent, option, out)
    return out


def check_output_dir(path: str | Path, option: str) -> Path:
    """``path`` as a folder the command may write into, made now (``option``
    names it in the error): not a file, and writable by this process."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{option} {out} is a file; give a folder for the output")
    _writable_folder(out, option, out)
    return out


def _writable_folder(folder: Path, option: str, shown: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"{option} {shown}: cannot create {folder} "
                              f"({exc.strerror or exc}); choose another path") from None
    try:
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".forerun-write-check-")
    except OSError as exc:
        raise OutputPathError(f"{option} {shown}: cannot write in {folder} "
                              f"({exc.strerror or exc}); choose another path") from None
    probe.close()


@contextlib.contextmanager
def written_whole(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed to ``path`` when
    the block ends without an error, removed when it raises.  The file gets
    the mode the umask gives a new file (a temporary file is made 0600)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask (read by setting it and back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
