"""Turning a model specification into config, weights and tokenizer.

A specification is a preset name, a path to a ``.gguf`` file, or a Hugging
Face folder (``config.json``, safetensors weights, ``tokenizer.json``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forerun.architectures import ARCHITECTURES
from forerun.errors import (
    CacheError,
    ConfigError,
    ModelFormatError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from forerun.loading.cache_entry import CacheEntry, ensure
from forerun.loading.content_key import file_digest
from forerun.loading.conversion_cache import convert_gguf
from forerun.loading.gguf_file import GGUFFile
from forerun.loading.presets import PRESETS, resolve_preset
from forerun.loading.weights import SafetensorsWeights, safetensors_files
from forerun.machine.json_files import read_json_object
from forerun.machine.paths import cache_dir
from forerun.protocol.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, torch_unsupported
from forerun.tokenizer import Tokenizer, tokenizer_from_gguf_metadata, tokenizer_from_hf_folder


@dataclass
class ModelFiles:
    """What an engine needs to build a model."""

    name: str
    config: ModelConfig
    # None: a GGUF whose quantized network the torch engine builds from the
    # file itself (forerun.api.loader)
    weights: Mapping[str, torch.Tensor] | None
    tokenizer: Any  # forerun.tokenizer.Tokenizer
    gguf_path: Path | None = None


def _read_json(path: Path) -> dict:
    return read_json_object(path, ConfigError)


def resolve_spec(spec: str | Path, *, progress: bool = True) -> Path:
    """The file or folder a model specification names."""
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"a model is a preset name or a path, got {type(spec).__name__} "
                          f"{spec!r}")
    text = str(spec)
    if not text.strip():
        raise ModelNotFoundError(
            f"the model name is empty; give a preset ({', '.join(PRESETS)}), a .gguf file "
            f"or a Hugging Face folder")
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
    weights = SafetensorsWeights(safetensors_files(folder),
                                 transform=ARCHITECTURES[config.architecture].hf_weight)
    tokenizer = tokenizer_from_hf_folder(folder)
    return ModelFiles(folder.name, config, weights, tokenizer)


def load_converted(folder: Path, name: str, gguf_path: Path) -> ModelFiles:
    """A folder written by :func:`~forerun.loading.conversion_cache.convert_gguf`."""
    config = ModelConfig.from_dict(_read_json(folder / "config.json"))
    weights = SafetensorsWeights([folder / "model.safetensors"])
    tokenizer = Tokenizer.load(folder / "tokenizer")
    return ModelFiles(name, config, weights, tokenizer, gguf_path=gguf_path)


def resolve_model_path(spec: str | Path, *, progress: bool = True) -> Path:
    """:func:`resolve_spec`, refusing a file that is not a GGUF: a model
    folder or a ``.gguf`` file."""
    path = resolve_spec(spec, progress=progress)
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise ModelFormatError(
            f"{path} is neither a .gguf file nor a model folder; forerun loads GGUF files "
            f"and Hugging Face folders with safetensors weights")
    return path


def load_model_files(spec: str | Path, *, progress: bool = True) -> ModelFiles:
    """Resolve ``spec`` and read what the engine needs."""
    path = resolve_model_path(spec, progress=progress)
    name = str(spec) if str(spec) in PRESETS else path.name
    if path.is_dir():
        return load_hf_folder(path)
    header = load_gguf_files(path, engine="torch", progress=progress)
    converted = convert_gguf(path, progress=progress, digest=known_digest(spec))
    files = load_converted(converted, name, path)
    # (the header's config and tokenizer: the conversion cache keeps those
    # of the forerun version that converted it)
    files.config, files.tokenizer = header.config, header.tokenizer
    return files


def model_header(spec: str | Path, *, progress: bool = True) -> ModelFiles:
    """The config and tokenizer of ``spec`` alone (a GGUF's header, a
    folder's config and tokenizer files), no weights read: what a draft
    model is checked against its target by before it loads."""
    path = resolve_model_path(spec, progress=progress)
    if path.is_dir():
        return load_hf_folder(path)
    return load_gguf_files(spec, engine="torch", progress=progress)


def known_digest(spec: str | Path) -> str | None:
    """The SHA-256 of a preset's GGUF (checked when it was assembled)."""
    preset = PRESETS.get(str(spec))
    return preset.sha256 if preset is not None else None


def load_gguf_files(spec: str | Path, *, engine: str = "llama.cpp",
                    progress: bool = True) -> ModelFiles:
    """Config and tokenizer of a GGUF model read from its header, without
    touching the weights (no dequantization, no conversion cache): what an
    engine that runs the GGUF itself needs.  ``weights`` is empty.

    Parsing a header with a large vocabulary takes seconds, so the config and
    tokenizer are kept in ``<cache>/gguf-header/`` (a few MB, keyed like the
    conversion cache by the file's SHA-256, and by :data:`GGUF_HEADER_VERSION`)."""
    path = resolve_spec(spec, progress=progress)
    name = str(spec) if str(spec) in PRESETS else path.name
    if path.is_dir():
        raise ModelFormatError(
            f"the {engine} engine runs GGUF files, and {path} is a folder; give a preset "
            f"or a .gguf file, or load the folder with engine='torch'")
    if path.suffix.lower() != ".gguf":
        raise ModelFormatError(
            f"the {engine} engine runs GGUF files, and {path} is not a .gguf file")
    config, tokenizer = _gguf_header(path, known_digest(spec))
    if engine == "torch" and config.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(torch_unsupported(config.architecture, str(path)))
    return ModelFiles(name, config, {}, tokenizer, gguf_path=path)


# 3: the tokenizer saved in the form it loads fastest from (Tokenizer.save).
# 5: any architecture (the llama.cpp engine's), SentencePiece tokenizers,
# every end-of-turn token among the EOS ids.
# 6: the EOS, EOT and EOM ids the header names (end-of-turn tokens by their
# text: the Model's).
# The version is part of an entry's name, so that forerun versions sharing a
# cache each keep their own entry instead of rebuilding each other's; the
# other's is listed as written by another version, which a prune deletes.
GGUF_HEADER_VERSION = "6"


def _gguf_header(path: Path, digest: str | None = None) -> tuple[ModelConfig, Any]:
    """(config, tokenizer) of a GGUF file, from the header cache when it
    holds them.  The cache is optional: when it can't be used the header is
    parsed, with a warning."""
    import warnings

    parsed: list = []

    def read_header() -> list:
        # (the gguf package, and the yaml it imports, only where the header is parsed)

        gguf = GGUFFile(path)
        return [gguf.config(any_architecture=True), tokenizer_from_gguf_metadata(gguf.metadata)]

    def parse(out: Path) -> dict:
        parsed[:] = read_header()
        config, tokenizer = parsed
        (out / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        tokenizer.save(out / "tokenizer")
        return {"source": str(path.resolve()), "name": path.name}

    try:
        digest = digest or file_digest(path)
        entry = CacheEntry(cache_dir() / "gguf-header" / f"{digest[:32]}-v{GGUF_HEADER_VERSION}",
                           f"the parsed header of {path.name}", version=GGUF_HEADER_VERSION)
        folder = ensure(entry, parse, progress=False)
    except CacheError as exc:
        if not parsed:
            parsed[:] = read_header()
        warnings.warn(f"forerun: the GGUF header cache is not used: {exc}", stacklevel=3)
        return parsed[0], parsed[1]
    if parsed:
        return parsed[0], parsed[1]
    return (ModelConfig.from_dict(_read_json(folder / "config.json")),
            Tokenizer.load(folder / "tokenizer"))
