"""Converting a GGUF file once into a fast-loading folder.

Dequantizing a GGUF model takes tens of seconds; loading float32 safetensors
takes a few.  The first load of a GGUF file writes ``model.safetensors``,
``config.json`` and the tokenizer into ``<cache>/converted/<key>/``, where the
key is the SHA-256 of the GGUF's bytes (:mod:`~forerun.loading.content_key`),
so a moved or reassembled file finds its entry again.  The folder is a
:class:`~forerun.loading.cache_entry.CacheEntry`: checked at every load,
rebuilt when damaged, built under a lock and published atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

from forerun.loading.cache_entry import CacheEntry, ensure
from forerun.loading.content_key import file_digest
from forerun.loading.gguf_file import GGUFFile
from forerun.machine.paths import cache_dir
from forerun.tokenizer import tokenizer_from_gguf_metadata

CONVERTER_VERSION = "2"


def converted_entry(gguf_path: Path, digest: str | None = None) -> CacheEntry:
    """The cache entry of ``gguf_path``'s conversion; ``digest``: the file's
    SHA-256 when it is already known (a preset's)."""
    digest = digest or file_digest(gguf_path)
    return CacheEntry(cache_dir() / "converted" / digest[:32],
                      f"the converted weights of {gguf_path.name}",
                      version=CONVERTER_VERSION)


def convert_gguf(gguf_path: Path, *, progress: bool = True, digest: str | None = None) -> Path:
    """The converted folder of ``gguf_path``, converting it first if it is
    missing or damaged."""
    entry = converted_entry(gguf_path, digest)
    return ensure(entry, lambda tmp: _convert(gguf_path, tmp, progress), progress=progress)


def _convert(gguf_path: Path, out: Path, progress: bool) -> dict:
    from safetensors.numpy import save_file
    from tqdm import tqdm

    gguf = GGUFFile(gguf_path)
    config = gguf.config()
    tokenizer = tokenizer_from_gguf_metadata(gguf.metadata)
    tensors = {}
    for name, array in tqdm(gguf.weights(config), total=gguf.tensor_count(),
                            desc=f"converting {gguf_path.name}", unit="tensor",
                            disable=not progress, leave=False):
        tensors[name] = array
    save_file(tensors, str(out / "model.safetensors"),
              metadata={"source": str(gguf_path), "format": "pt"})
    del tensors
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    tokenizer.save(out / "tokenizer")
    return {"source": str(gguf_path.resolve()), "name": gguf_path.name}
