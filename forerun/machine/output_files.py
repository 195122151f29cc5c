"""Where a command writes its results: checked before any work starts, and
written whole or not at all.

A command that runs for minutes (a benchmark, a training run) checks its
output path first (:func:`check_output_file`, :func:`check_output_dir`), so
a path it can't write fails at once instead of losing the work at the end;
:func:`written_whole` writes through a temporary file in the same folder
and a rename, so a reader never sees half a file.  An empty or blank path is
refused (it would name the current folder).

A folder of forerun's artefacts (an exported head) carries a marker,
:data:`MARKER`, naming the files forerun wrote there and their stamps:
:func:`check_replaceable` refuses to replace any other file, or one changed
since, unless the user forces it, so a model folder given by mistake is
never overwritten.  A single file forerun writes carries its marker inside
(a Medusa file's format tag): :func:`check_replaceable_file`."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from forerun.errors import ForerunError


class OutputPathError(ForerunError):
    """An output path the command could not write."""


#: The file in a folder of forerun's artefacts that lists what forerun wrote.
MARKER = "forerun-files.json"


def check_output_file(path: str | Path, option: str) -> Path:
    """``path`` as a file the command may write (``option`` names it in the
    error): not empty, not a folder, in a folder that exists or can be made
    and that this process may write."""
    _not_blank(path, option, "file")
    out = Path(path).expanduser()
    if out.is_dir():
        raise OutputPathError(f"{option} {out} is a folder; give a file name, e.g. "
                              f"{out / 'heads.safetensors'}")
    _writable_folder(out.parent, option, out)
    return out


def check_output_dir(path: str | Path, option: str) -> Path:
    """``path`` as a folder the command may write into, made now (``option``
    names it in the error): not empty, not a file, and writable by this
    process."""
    _not_blank(path, option, "folder")
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{option} {out} is a file; give a folder for the output")
    _writable_folder(out, option, out)
    return out


def _not_blank(path: str | Path, option: str, what: str) -> None:
    if not str(path).strip():
        raise OutputPathError(f"{option} is empty; give a {what} to write (an empty path would "
                              f"write into the current folder)")


def check_replaceable(folder: Path, names: list[str], option: str, *, force: bool = False,
                      hint: str = "--force") -> None:
    """Refuse to replace a file of ``names`` in ``folder`` that forerun did
    not write there (the folder's :data:`MARKER` does not list it), or that
    changed since, naming the file; ``force``: replace it anyway."""
    if force:
        return
    written = _written(folder)
    for name in names:
        path = folder / name
        if path.exists() and written.get(name) != _stamp(path):
            raise OutputPathError(
                f"{option} {folder} holds {name}, which forerun did not write there (or which "
                f"changed since): it is not replaced; choose another folder, or pass {hint} "
                f"to replace it")


def check_replaceable_file(path: Path, option: str, kind: str, ours: Callable[[Path], bool],
                           *, force: bool = False, hint: str = "--force") -> None:
    """Refuse to replace the file ``path`` unless it is forerun's own ``kind``
    (``ours(path)`` says so from the file's own marker, e.g. a format tag
    in its metadata) or ``force``: a file forerun did not write is never
    overwritten by mistake."""
    if force or not path.exists() or ours(path):
        return
    raise OutputPathError(
        f"{option} {path} exists and is not {kind} that forerun wrote: it is not replaced; "
        f"choose another path, or pass {hint} to replace it")


def record_written(folder: Path, names: list[str], kind: str) -> None:
    """List ``names`` in ``folder``'s :data:`MARKER` as written by forerun now."""
    files = {**_written(folder), **{name: _stamp(folder / name) for name in names}}
    text = json.dumps({"kind": kind, "files": files}, indent=1, sort_keys=True) + "\n"
    with written_whole(folder / MARKER) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _written(folder: Path) -> dict:
    try:
        files = json.loads((folder / MARKER).read_text(encoding="utf-8"))["files"]
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


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
