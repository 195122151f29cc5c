"""Where forerun keeps assembled preset files and converted models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$FORERUN_CACHE`` if set, else ``$XDG_CACHE_HOME/forerun``, else
    ``~/.cache/forerun``.  Created on first use."""
    env = os.environ.get("FORERUN_CACHE")
    if env:
        path = Path(env).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(base) / "forerun"
    path.mkdir(parents=True, exist_ok=True)
    return path
