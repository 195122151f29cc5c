"""Reading the small JSON files that come with models (config.json,
generation_config.json, tokenizer_config.json...)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forerun.errors import ForerunError


def read_json_object(path: Path, error: type[ForerunError], *,
                     missing_ok: bool = False) -> dict[str, Any]:
    """The JSON object in ``path``.  A file that can't be read, isn't JSON
    or holds something other than an object raises ``error`` naming the
    file.  ``missing_ok``: a missing file reads as ``{}``."""
    if missing_ok and not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise error(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object")
    return data
