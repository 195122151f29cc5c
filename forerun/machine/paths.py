"""Where forerun keeps assembled preset files and converted models."""

from __future__ import annotations

import os
from pathlib import Path

from forerun.errors import CacheError


def cache_dir() -> Path:
    """``$FORERUN_CACHE`` if set, else ``$XDG_CACHE_HOME/forerun``, else
    ``~/.cache/forerun``.  Created on first use.

    A path that is a file, or a folder that can't be created, raises
    :class:`~forerun.errors.CacheError` saying how to pick another one.  A
    folder that exists but is read-only is returned: reading entries that
    are already there still works, and each write reports its own error."""
    env = os.environ.get("FORERUN_CACHE")
    if env:
        path = Path(env).expanduser()
        where = f"FORERUN_CACHE={env}"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(base) / "forerun"
        where = f"forerun's cache directory {path}"
    if path.is_dir():
        return path
    # No "exists, so it is a file" check first: another process may create
    # the folder between the two checks (two forerun processes on a fresh
    # cache).  mkdir with exist_ok takes a folder made meanwhile and fails
    # with FileExistsError only when the path is something else.
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise CacheError(f"{where} is not a directory (it is a file); remove it, or set "
                         f"FORERUN_CACHE to a writable directory") from exc
    except OSError as exc:
        raise CacheError(f"{where} can't be created ({exc.strerror or exc}); set "
                         f"FORERUN_CACHE to a writable directory") from exc
    return path
