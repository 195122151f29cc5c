"""A drafter's training checkpoint: one file, written whole, that a resumed
run continues from, and the checks that keep a run from continuing another
run's checkpoint (other settings, data or target would train another
drafter under the first one's name).

Used by EAGLE's and Medusa's trainers; each names its own ``fmt`` (the
file's kind) and the settings and data that make its identity."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from forerun.errors import ForerunError
from forerun.machine.output_files import written_whole


class CheckpointError(ForerunError):
    """A training checkpoint that can't be used."""


def check_checkpoint_path(path: Path | None, resume: bool) -> None:
    """Refuse to start over an earlier run's checkpoint, or to resume none."""
    if path is not None and path.exists() and not resume:
        raise CheckpointError(f"{path} holds the checkpoint of an earlier run; continue it "
                              f"with --resume, or delete it to start again")
    if resume and (path is None or not path.is_file()):
        raise CheckpointError(f"nothing to resume: no checkpoint at {path}")


def write_checkpoint(path: Path, fmt: str, version: int, payload: dict[str, Any]) -> None:
    """``payload`` (tensors, numbers, strings, lists and dicts of them) to
    ``path``, renamed into place once whole: a stop while writing leaves the
    checkpoint before it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(path) as tmp:
        torch.save({"format": fmt, "version": version, **payload}, str(tmp))


def read_checkpoint(path: Path, fmt: str, version: int, command: str) -> dict[str, Any]:
    """The checkpoint at ``path``, made by ``command`` (``fmt``, ``version``),
    or a :class:`CheckpointError` that says what is wrong with it."""
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:       # torch raises many kinds for a bad file
        raise CheckpointError(f"{path} is not a readable training checkpoint ({exc}); delete "
                              f"it to start again") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise CheckpointError(f"{path} is not a checkpoint of {command}")
    if data.get("version") != version:
        raise CheckpointError(f"{path} is a checkpoint of version {data.get('version')}; "
                              f"this forerun reads version {version}")
    return data


def check_identity(path: Path | None, stored: Mapping[str, Any], now: Mapping[str, Any], *,
                   settings: Iterable[str], data: Mapping[str, str]) -> None:
    """Refuse to resume with other settings or data: ``stored`` and ``now``
    hold ``"settings"`` (compared by the names in ``settings``) and
    ``"data"`` (digests, compared by the keys of ``data``, which say what
    each is)."""
    problems = []
    old, new = stored["settings"], now["settings"]
    for name in settings:
        if old.get(name) != new.get(name):
            problems.append(f"{name.replace('_', '-')}: {json.dumps(old.get(name))} in the "
                            f"checkpoint, {json.dumps(new.get(name))} now")
    for key, text in data.items():
        if stored["data"].get(key) != now["data"].get(key):
            problems.append(f"{text} differ")
    if problems:
        raise CheckpointError(
            f"--resume would continue {path} with other settings or data than it was "
            f"made with, and so train another drafter: " + "; ".join(problems)
            + ". Give the same options and data, or delete the checkpoint to start again")
