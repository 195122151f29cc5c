"""Converting a GGUF file once into a fast-loading folder.

Dequantizing a GGUF model takes tens of seconds; loading float32 safetensors
takes a few.  The first load of a GGUF file writes ``model.safetensors``,
``config.json`` and the tokenizer into ``<cache>/converted/<name>-<key>/``,
where the key depends on the file's path, size and modification time and on
this converter's version; later loads read that folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..paths import cache_dir
from .gguf_file import GGUFFile

CONVERTER_VERSION = "1"
COMPLETE_MARKER = "complete"


def converted_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(
        f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()
    ).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf_path.stem}-{key}"


def is_converted(gguf_path: Path) -> bool:
    return (converted_dir(gguf_path) / COMPLETE_MARKER).is_file()


def convert_gguf(gguf_path: Path, *, progress: bool = True) -> Path:
    """The converted folder of ``gguf_path``, converting it first if needed."""
    target = converted_dir(gguf_path)
    if (target / COMPLETE_MARKER).is_file():
        return target
    from safetensors.numpy import save_file
    from tqdm import tqdm

    from ..tokenizer import tokenizer_from_gguf_metadata

    gguf = GGUFFile(gguf_path)
    config = gguf.config()
    tokenizer = tokenizer_from_gguf_metadata(gguf.metadata)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    for name, array in tqdm(gguf.weights(config), total=gguf.tensor_count(),
                            desc=f"converting {gguf_path.name}", unit="tensor",
                            disable=not progress, leave=False):
        tensors[name] = array
    save_file(tensors, str(tmp / "model.safetensors"),
              metadata={"source": str(gguf_path), "format": "pt"})
    del tensors
    (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    tokenizer.save(tmp / "tokenizer")
    (tmp / COMPLETE_MARKER).write_text(str(gguf_path.resolve()))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target
