"""Lazy access to tensors stored in one or more safetensors files.

The engine pulls tensors one at a time while it builds its fused weights, so
peak memory stays near the model's own size instead of twice it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from forerun.errors import ModelFormatError, ModelNotFoundError


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """A read-only mapping ``name -> tensor`` over safetensors files; each
    lookup reads that tensor from disk (and passes it through
    ``transform(name, tensor)`` when one is given)."""

    def __init__(self, files: list[Path], *,
                 transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        from safetensors import safe_open

        self._transform = transform
        self._handles = []
        self._where: dict[str, int] = {}
        for i, f in enumerate(files):
            if not f.is_file():
                raise ModelNotFoundError(f"weight file {f} does not exist")
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as exc:
                raise ModelFormatError(f"{f} is not a readable safetensors file: {exc}") from exc
            self._handles.append(handle)
            for name in handle.keys():
                self._where[name] = i

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._handles[self._where[name]].get_tensor(name)
        return tensor if self._transform is None else self._transform(name, tensor)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: the shards an index names,
    or every ``*.safetensors`` file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFormatError(f"{index} is not a valid safetensors index: {exc}") from exc
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ModelFormatError(f"{index} is not a valid safetensors index: its weight_map "
                                   f"must map tensor names to file names")
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"{folder} has no *.safetensors weights (forerun does not read .bin or .pt "
            f"checkpoints; convert them to safetensors first)")
    return files
