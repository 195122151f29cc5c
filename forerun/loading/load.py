"""Turning a model specification into config, weights and tokenizer.

A specification is a preset name, a path to a ``.gguf`` file, or a Hugging
Face folder (``config.json``, safetensors weights, ``tokenizer.json``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..config import ModelConfig
from ..errors import ConfigError, ModelFormatError, ModelNotFoundError
from ..json_files import read_json_object
from .presets import PRESETS, resolve_preset
from .weights import SafetensorsWeights, safetensors_files


@dataclass
class ModelFiles:
    """What an engine needs to build a model."""

    name: str
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    tokenizer: Any  # forerun.tokenizer.Tokenizer
    gguf_path: Path | None = None


def _read_json(path: Path) -> dict:
    return read_json_object(path, ConfigError)


def resolve_spec(spec: str | Path, *, progress: bool = True) -> Path:
    """The file or folder a model specification names."""
    text = str(spec)
    if text in PRESETS:
        return resolve_preset(text, progress=progress)
    path = Path(text).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(
        f"{text!r} is neither a preset nor an existing path; presets are "
        f"{', '.join(PRESETS)}, paths may name a .gguf file or a Hugging Face folder")


def load_hf_folder(folder: Path) -> ModelFiles:
    """Config, lazy weights and tokenizer of a Hugging Face model folder."""
    from ..tokenizer import tokenizer_from_hf_folder

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    hf = _read_json(config_path)
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        eos = _read_json(gen_path).get("eos_token_id")
        if eos is not None:
            hf = {**hf, "eos_token_id": eos}
    config = ModelConfig.from_hf(hf, source=str(config_path))
    weights = SafetensorsWeights(safetensors_files(folder))
    tokenizer = tokenizer_from_hf_folder(folder)
    return ModelFiles(folder.name, config, weights, tokenizer)


def load_converted(folder: Path, name: str, gguf_path: Path) -> ModelFiles:
    """A folder written by :func:`~forerun.loading.conversion_cache.convert_gguf`."""
    from ..tokenizer import Tokenizer

    config = ModelConfig.from_dict(_read_json(folder / "config.json"))
    weights = SafetensorsWeights([folder / "model.safetensors"])
    tokenizer = Tokenizer.load(folder / "tokenizer")
    return ModelFiles(name, config, weights, tokenizer, gguf_path=gguf_path)


def load_model_files(spec: str | Path, *, progress: bool = True) -> ModelFiles:
    """Resolve ``spec`` and read what the engine needs."""
    from .conversion_cache import convert_gguf

    path = resolve_spec(spec, progress=progress)
    name = str(spec) if str(spec) in PRESETS else path.name
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix.lower() != ".gguf":
        raise ModelFormatError(
            f"{path} is neither a .gguf file nor a model folder; forerun loads GGUF files "
            f"and Hugging Face folders with safetensors weights")
    return load_converted(convert_gguf(path, progress=progress), name, path)


def load_gguf_files(spec: str | Path, *, engine: str = "llama.cpp",
                    progress: bool = True) -> ModelFiles:
    """Config and tokenizer of a GGUF model read from its header, without
    touching the weights (no dequantization, no conversion cache): what an
    engine that runs the GGUF itself needs.  ``weights`` is empty.

    Parsing a header with a large vocabulary takes seconds, so the config and
    tokenizer are kept in ``<cache>/gguf-header/`` (a few MB, keyed like the
    conversion cache by the file's path, size and modification time)."""
    path = resolve_spec(spec, progress=progress)
    name = str(spec) if str(spec) in PRESETS else path.name
    if path.is_dir():
        raise ModelFormatError(
            f"the {engine} engine runs GGUF files, and {path} is a folder; give a preset "
            f"or a .gguf file, or load the folder with engine='torch'")
    if path.suffix.lower() != ".gguf":
        raise ModelFormatError(
            f"the {engine} engine runs GGUF files, and {path} is not a .gguf file")
    config, tokenizer = _gguf_header(path)
    return ModelFiles(name, config, {}, tokenizer, gguf_path=path)


GGUF_HEADER_VERSION = "1"


def _gguf_header(path: Path) -> tuple[ModelConfig, Any]:
    """(config, tokenizer) of a GGUF file, from the header cache when it
    holds them."""
    import hashlib
    import os
    import shutil

    from ..paths import cache_dir
    from ..tokenizer import Tokenizer, tokenizer_from_gguf_metadata
    from .gguf_file import GGUFFile

    st = path.stat()
    key = hashlib.sha256(
        f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{GGUF_HEADER_VERSION}".encode()
    ).hexdigest()[:16]
    folder = cache_dir() / "gguf-header" / f"{path.stem}-{key}"
    if (folder / "complete").is_file():
        try:
            return (ModelConfig.from_dict(_read_json(folder / "config.json")),
                    Tokenizer.load(folder / "tokenizer"))
        except Exception:   # a damaged entry: read the file again
            pass
    gguf = GGUFFile(path)
    config = gguf.config()
    tokenizer = tokenizer_from_gguf_metadata(gguf.metadata)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        tokenizer.save(tmp / "tokenizer")
        (tmp / "complete").write_text(str(path.resolve()))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError:   # a read-only cache only costs the next load the parse
        shutil.rmtree(tmp, ignore_errors=True)
    return config, tokenizer
